"""Models this project did not build: what torch.onnx.export writes, cut and checked."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch==2.13.0)")
nn = torch.nn

from edgert.exporter.check import check_plan  # noqa: E402
from edgert.exporter.export import ExportOptions, export_plan  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    # the legacy TorchScript exporter is the one that writes training-mode graphs; its warnings are expected
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16), nn.ReLU())
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x) + x
        x = self.layer2(x)
        return self.fc(self.drop(x.flatten(1)))


class SmallTransformer(nn.Module):
    def __init__(self, vocab=16, width=16, heads=2, length=8, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, length, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 32, dropout=0.1, batch_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.norm(self.encoder(self.embed(tokens) + self.pos)).mean(1))


def export_training_mode(module, example, path, input_name):
    torch.manual_seed(0)
    module.train()
    torch.onnx.export(
        module, (example,), str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False, input_names=[input_name], output_names=["logits"],
        dynamic_axes={input_name: {0: "N"}, "logits": {0: "N"}}, opset_version=17,
    )
    return path


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_torch_cnn_with_batchnorm(tmp_path, stages):
    torch.manual_seed(0)
    path = export_training_mode(SmallCNN(), torch.randn(2, 1, 8, 8), tmp_path / "cnn.onnx", "input")
    manifest = export_plan(path, tmp_path / "plan", ExportOptions(stages=stages))
    assert len(manifest.stages) == stages
    assert any(s.buffer_updates for s in manifest.stages)  # BatchNorm running statistics are tracked
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()
    assert report.max_grad_rel_diff <= 1e-4 and report.max_param_rel_diff <= 1e-4


@pytest.mark.parametrize("stages", [1, 3])
def test_torch_transformer(tmp_path, stages):
    torch.manual_seed(0)
    path = export_training_mode(SmallTransformer(), torch.randint(0, 16, (2, 8)), tmp_path / "tr.onnx", "tokens")
    manifest = export_plan(path, tmp_path / "plan", ExportOptions(stages=stages))
    assert manifest.model_input[0].dtype == "int64"
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()
    assert report.max_grad_rel_diff <= 1e-4 and report.max_param_rel_diff <= 1e-4


class EveryOp(nn.Module):
    """The operators a torch user's model brings, one after another: each one's gradient must be portable."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 6, 3, padding=1)
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.pool = nn.AvgPool2d(2)
        self.squeeze = nn.AdaptiveAvgPool2d(1)
        self.act = nn.LeakyReLU(0.1)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(4 * 4 * 4, 24)
        self.head = nn.Linear(25, 5)

    def forward(self, x):
        y = torch.sigmoid(self.conv(x)) * torch.tanh(self.conv(x))
        y = self.act(self.pool(self.up(y)))                                # ConvTranspose, AveragePool, LeakyRelu
        gate = torch.softmax(self.squeeze(y).flatten(1), dim=1)            # GlobalAveragePool, Softmax
        y = y.permute(0, 2, 3, 1).reshape(y.shape[0], -1)                 # Transpose, Reshape
        a, b = torch.split(self.drop(self.fc(y)), [8, 16], dim=1)          # Dropout, Split
        y = torch.cat([a * 2, b[:, 1:15:2].repeat(1, 2)], dim=1)           # Slice with a step, Concat
        return self.head(torch.cat([y, gate], dim=1)[:, 1:])


class Recurrent(nn.Module):
    def __init__(self, vocab=12, width=8, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.gru = nn.GRU(width, 8, batch_first=True, bidirectional=True)
        self.lstm = nn.LSTM(16, 6, num_layers=2, batch_first=True)
        self.head = nn.Linear(6, classes)

    def forward(self, tokens):
        y, _ = self.gru(self.embed(tokens))
        y, (h, _) = self.lstm(y)
        return self.head(y[:, -1] + h[-1])


def _training_build_ops(plan):
    """Operators in the plan's runtime graphs that only the training build runs."""
    import onnx

    from edgert.exporter.portable import ai_onnx_opset, runs_on_stock
    from edgert.manifest import RUNTIME_ROLES, STASH_ROLES, load_manifest

    found = set()
    manifest = load_manifest(plan)
    for entry in manifest.stages:
        for artifact in entry.artifacts:
            if artifact.role in RUNTIME_ROLES + STASH_ROLES and artifact.path.endswith(".onnx"):
                model = onnx.load(str(plan / artifact.path))
                found |= {n.op_type for n in model.graph.node if not runs_on_stock(n, ai_onnx_opset(model))}
    return found


@pytest.mark.parametrize("stages", [1, 3])
def test_torch_model_with_every_listed_operator_is_portable(tmp_path, stages):
    torch.manual_seed(0)
    path = export_training_mode(EveryOp(), torch.randn(2, 2, 4, 4), tmp_path / "ops.onnx", "input")
    manifest = export_plan(path, tmp_path / "plan", ExportOptions(stages=stages))
    assert len(manifest.stages) == stages
    assert _training_build_ops(tmp_path / "plan") == set()
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()
    assert any("reference: the unsplit model as one portable stage" in note for note in report.notes)


@pytest.mark.parametrize("stages", [1, 2])
def test_torch_gru_and_lstm_unrolled_and_portable(tmp_path, stages):
    torch.manual_seed(0)
    path = export_training_mode(Recurrent(), torch.randint(0, 12, (2, 5)), tmp_path / "rnn.onnx", "tokens")
    manifest = export_plan(path, tmp_path / "plan", ExportOptions(stages=stages))
    assert len(manifest.stages) == stages
    assert _training_build_ops(tmp_path / "plan") == set()
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()
    assert report.max_portable_rel_diff <= 1e-5 and len(report.portable) == 2 * stages - 1
