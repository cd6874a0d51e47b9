"""Models this project did not build: what torch.onnx.export writes, cut and checked."""

import numpy as np
import onnxruntime
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


class ResidualBlock(nn.Module):
    """torchvision's BasicBlock in small: conv-BN-ReLU-conv-BN, plus a 1x1 conv-BN shortcut when the shape changes."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class TinyResNet(nn.Module):
    """A torchvision-style ResNet in miniature: stem, two residual stages, global pooling, classifier."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = ResidualBlock(8, 8)
        self.layer2 = ResidualBlock(8, 16, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        return self.fc(self.pool(self.layer2(self.layer1(self.stem(x)))).flatten(1))


def export_training_mode(module, example, path, input_name):
    """The export docs/EXPORTER.md recommends: training mode, no constant folding."""
    torch.manual_seed(0)
    module.train()
    torch.onnx.export(
        module, (example,), str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False, input_names=[input_name], output_names=["logits"],
        dynamic_axes={input_name: {0: "N"}, "logits": {0: "N"}}, opset_version=17,
    )
    return path


def export_eval_mode(module, example, path, input_name):
    """The usual export: eval mode, constant folding on (BatchNorm folds into the convolutions, and equal
    initializers are merged into one read through Identity nodes)."""
    module.eval()
    torch.onnx.export(
        module, (example,), str(path), dynamo=False, input_names=[input_name], output_names=["logits"],
        dynamic_axes={input_name: {0: "N"}, "logits": {0: "N"}}, opset_version=17,
    )
    return path


MODELS = {
    "resnet": (TinyResNet, lambda: torch.randn(2, 3, 16, 16), "input"),
    "transformer": (SmallTransformer, lambda: torch.randint(0, 16, (2, 8)), "tokens"),
}
EXPORTS = {"training": export_training_mode, "eval": export_eval_mode}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(model, way)``: MODELS[model] exported by EXPORTS[way], once per module."""
    folder, paths = tmp_path_factory.mktemp("torch-exports"), {}

    def get(model: str, way: str):
        if (model, way) not in paths:
            torch.manual_seed(0)
            module, example, input_name = MODELS[model]
            paths[model, way] = EXPORTS[way](module(), example(), folder / f"{model}-{way}.onnx", input_name)
        return paths[model, way]

    return get


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("way", ["eval", "training"])
@pytest.mark.parametrize("model", ["resnet", "transformer"])
def test_torch_export_either_way_trains_in_1_to_3_stages(exported, tmp_path, model, way, stages):
    notes = []
    manifest = export_plan(exported(model, way), tmp_path / "plan", ExportOptions(stages=stages), notes.append)
    assert len(manifest.stages) == stages
    assert all(any(p.trainable for p in s.parameters) for s in manifest.stages), notes
    if model == "transformer":
        assert manifest.model_input[0].dtype == "int64"  # the token ids stay integers
    if model == "resnet":  # BatchNorm trains as BatchNorm from a training-mode export, as folded convolutions else
        assert any(s.buffer_updates for s in manifest.stages) == (way == "training")
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()


def _merged_pairs(path):
    """(kept, merged) names of every Identity of an initializer in an exported model."""
    import onnx

    graph = onnx.load(str(path)).graph
    initializers = {i.name for i in graph.initializer}
    return [(n.input[0], n.output[0]) for n in graph.node if n.op_type == "Identity" and n.input[0] in initializers]


def test_parameters_merged_by_value_train_apart_and_merge_back(exported, tmp_path):
    """Layers of nn.TransformerEncoder start as copies: an eval export merges them, edgert trains them apart."""
    from edgert.chain import StageChain
    from edgert.exporter.merge import merge_run
    from edgert.weights import StageState, save_state

    path = exported("transformer", "eval")
    pairs = _merged_pairs(path)
    assert len(pairs) >= 4  # the second layer's weights, and equal biases
    notes = []
    plan = tmp_path / "run" / "plan"
    manifest = export_plan(path, plan, ExportOptions(stages=2), notes.append)
    assert any(f"{len(pairs)} initializer(s) the exporter had merged" in note for note in notes), notes
    chain = StageChain(plan)
    rng = np.random.default_rng(0)
    tokens, labels = rng.integers(0, 16, (8, 8)), {manifest.labels[0].name: rng.integers(0, 4, (8,))}
    before = chain.parameters()
    assert all(np.array_equal(before[kept], before[merged]) for kept, merged in pairs)
    for _ in range(2):
        chain.train_batch({"tokens": tokens}, labels)
        chain.step()
    after = chain.parameters()
    assert all(not np.array_equal(after[kept], after[merged]) for kept, merged in pairs)

    latest = tmp_path / "run" / "checkpoints" / "latest"
    for k, stage in enumerate(chain.stages):
        save_state(StageState(parameters=stage.parameters(), step=1, stage=k), latest / f"stage{k}.cbor")
    (latest / "checkpoint.json").write_text('{"step": 1, "epoch": 0, "stages": 2}')
    merge_run(tmp_path / "run", tmp_path / "merged.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "merged.onnx"), providers=["CPUExecutionProvider"])
    merged = session.run(None, {"tokens": tokens})[0]
    np.testing.assert_allclose(merged, chain.infer({"tokens": tokens}), rtol=1e-5, atol=1e-5)


def test_batchnorm_folded_by_an_eval_export_is_said(exported, tmp_path):
    notes = []
    export_plan(exported("resnet", "eval"), tmp_path / "plan", ExportOptions(stages=1), notes.append)
    assert any("train as plain convolutions" in n and "training=torch.onnx.TrainingMode.TRAINING" in n
               for n in notes), notes


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_torch_cnn_with_batchnorm(tmp_path, stages):
    torch.manual_seed(0)
    path = export_training_mode(SmallCNN(), torch.randn(2, 1, 8, 8), tmp_path / "cnn.onnx", "input")
    manifest = export_plan(path, tmp_path / "plan", ExportOptions(stages=stages))
    assert len(manifest.stages) == stages
    assert any(s.buffer_updates for s in manifest.stages)  # BatchNorm running statistics are tracked
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()


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

    from edgert.exporter.standard_ops import ai_onnx_opset, runs_on_stock
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


@pytest.mark.parametrize("stages", [1, 2])
def test_torch_gru_and_lstm_unrolled_and_portable(tmp_path, stages):
    torch.manual_seed(0)
    path = export_training_mode(Recurrent(), torch.randint(0, 12, (2, 5)), tmp_path / "rnn.onnx", "tokens")
    manifest = export_plan(path, tmp_path / "plan", ExportOptions(stages=stages))
    assert len(manifest.stages) == stages
    assert _training_build_ops(tmp_path / "plan") == set()
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()
