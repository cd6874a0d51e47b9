"""Real models exported from PyTorch, whose stages hold far more state than one CoAP message: a ResNet-50
(25.6 million parameters, torchvision's architecture written in plain ``torch.nn``) at 2 and 4 stages trains,
has a worker and then the coordinator killed (``kill -9``), resumes and merges; a transformer of about 100
million parameters in 4 stages checkpoints and merges (docs/PROTOCOL.md §12, "Bodies in pieces")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch==2.13.0)")
nn = torch.nn

from edgert.exporter.export import ExportOptions, export_plan  # noqa: E402
from edgert.manifest import load_manifest  # noqa: E402
from tests.faulty_runs import FaultyRun, check_merged, train_through_faults  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 block: 1x1, 3x3 (strided), 1x1 convolutions, each with BatchNorm."""

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        c_out = width * 4
        self.conv1, self.bn1 = nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.downsample = None if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """torchvision.models.resnet50(weights=None): 25,557,032 parameters."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.relu, self.maxpool = nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        layers, c_in = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = []
            for k in range(blocks):
                stage.append(Bottleneck(c_in, width, stride if k == 0 else 1))
                c_in = width * 4
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(2048, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class TextClassifier(nn.Module):
    """A BERT-base-sized encoder classifying token sequences: 16k-token embedding, 12 layers of d=768."""

    def __init__(self, vocab: int = 16000, d: int = 768, layers: int = 12, classes: int = 4, length: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.zeros(1, length, d))
        # no dropout: the merged model must score the test set as the run's evaluation did, and a training-mode
        # export keeps Dropout in training form (removing it is merge's business, not this test's)
        layer = nn.TransformerEncoderLayer(d, 12, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.position).mean(dim=1))


def export(module: nn.Module, example, path: Path, input_name: str) -> Path:
    """The export docs/EXPORTER.md recommends: training mode, no constant folding, a dynamic batch."""
    module.train()
    torch.onnx.export(module, (example,), str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, input_names=[input_name], output_names=["logits"],
                      dynamic_axes={input_name: {0: "N"}, "logits": {0: "N"}}, opset_version=17)
    return path


@pytest.fixture(scope="module")
def resnet50(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = ResNet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032
    return export(model, torch.randn(2, 3, 32, 32), tmp_path_factory.mktemp("resnet50") / "resnet50.onnx", "input")


def image_data(path: Path, train: int = 32, test: int = 16) -> Path:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((train + test, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, train + test).astype(np.int64)
    np.savez(path, x=x[:train], y=y[:train], x_test=x[train:], y_test=y[train:])
    return path


@pytest.mark.parametrize("stages", [2, 4])
def test_resnet50_trains_recovers_resumes_and_merges(resnet50, stages, tmp_path):
    plan = tmp_path / "plan"
    export_plan(resnet50, plan, ExportOptions(stages=stages))
    assert len(load_manifest(plan).stages) == stages
    train_through_faults(plan, image_data(tmp_path / "images.npz"), stages,
                         FaultyRun(steps=12, batch_size=4, kill_worker_at=4, kill_coordinator_at=8), tmp_path)


def test_a_transformer_of_100m_parameters_in_4_stages_checkpoints_and_merges(tmp_path):
    import json
    import subprocess
    import sys

    from edgert.bench.faults import MetricsTail
    from edgert.coordinator.localcluster import LocalCluster

    torch.manual_seed(0)
    model = TextClassifier()
    assert 95e6 < sum(p.numel() for p in model.parameters()) < 110e6
    source = export(model, torch.randint(0, 16000, (2, 16)), tmp_path / "encoder.onnx", "tokens")
    del model
    export_plan(source, tmp_path / "plan", ExportOptions(stages=4))
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 16000, (24, 16)).astype(np.int64)
    labels = (tokens[:, 0] % 4).astype(np.int64)
    data = tmp_path / "tokens.npz"
    np.savez(data, x=tokens[:16], y=labels[:16], x_test=tokens[16:], y_test=labels[16:])
    out = tmp_path / "run"
    with LocalCluster(4, log_dir=tmp_path / "logs", start_timeout=120) as cluster:
        done = subprocess.run([sys.executable, "-m", "edgert", "train", str(tmp_path / "plan"), "--workers",
                               ",".join(cluster.urls), "--out", str(out), "--data", str(data), "--steps", "4",
                               "--epochs", "1000", "--batch-size", "4", "--insecure", "--listen",
                               "coap+tcp://127.0.0.1:0", "--central-every", "2", "--replicate-every", "2",
                               "--step-timeout", "900", "--json"], capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["steps"] == 4
    checkpoint = out / "checkpoints" / "latest"
    assert sum(p.stat().st_size for p in checkpoint.glob("stage*.cbor")) > 1.1e9  # 100M x (weights + 2 Adam)
    merged = tmp_path / "merged.onnx"
    done = subprocess.run([sys.executable, "-m", "edgert", "merge", str(out), "-o", str(merged)], capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    tail = MetricsTail(out)
    tail.poll()
    check_merged(merged, checkpoint, data, tail)
