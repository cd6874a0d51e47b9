"""Coverage against torch autograd (issue 29, item 3): torchvision, timm and transformers models with random weights,
exported by either of torch's exporters in training or eval mode, cut into 1, 2 or 4 stages, must train as torch does.

Each case exports the model (tests/exporter/torch_zoo.py), runs ``edgert export`` (``export_plan``) into N stages,
trains one batch of 8 through the stages chained in one process (``edgert.chain.StageChain``) and compares the loss
and every trained initializer's gradient with torch autograd on the same batch in float64. The metric
(tests/exporter/torch_coverage.py): per torch module (a parameter group; the loss is one too), the largest absolute
difference over the group's tensors divided by the group's largest float64 gradient; a case passes when every
trained initializer was matched to a torch parameter and every group's error is at most max(4 x torch float32's
own error in that group, 1e-5).

By default (CI) every model runs once: the TorchScript exporter, training mode, 2 stages. The full matrix
(2 exporters x 2 modes x 1, 2, 4 stages per model) is

    EDGERT_TORCH_MATRIX=full python -m pytest -q -m torch tests/exporter/test_torch_coverage.py

and ``python tools/coverage_table.py`` writes it as the table of docs/MODELS.md. Cases edgert cannot take today are
``xfail(strict=True)`` with the one line edgert gives (KNOWN_FAILURES): one that starts to pass fails the run, so
the entry must go.
"""

from __future__ import annotations

import os

import onnx
import pytest

from edgert.exporter.export import ExportOptions, export_plan

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install -e '.[torch]')")

from edgert.exporter.errors import ModelLoadError  # noqa: E402
from tests.exporter.torch_coverage import (  # noqa: E402
    ERROR_FLOOR,
    export_once,
    run_case,
    sgd_comparison,
)
from tests.exporter.torch_zoo import EXPORTERS, MODELS, MODES  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
]

MATRIX_VARIABLE = "EDGERT_TORCH_MATRIX"
STAGES = (1, 2, 4)
CI_SHARE = ("torchscript", "training", 2)  # (exporter, mode, stages) every model runs with by default
SGD_MODELS = ("squeezenet1_1", "vit_b_16_small", "bert_small", "lstm_classifier")


def known_failure(model: str, exporter: str, mode: str, stages: int) -> str | None:
    """Why edgert cannot take this case today (the start of the line it gives), or None."""
    for (m, e, o, s), reason in KNOWN_FAILURES.items():
        if m in (model, "*") and e in (exporter, "*") and o in (mode, "*") and s in (stages, "*"):
            return reason
    return None


# (model, exporter, mode, stages) with "*" for any -> the one-line error edgert gives (its start), on the gradient
# path of the ORT training build, from the part of the full matrix run so far (/work/coverage_before.md); the lead's
# own gradient builder removes entries as cases start to pass, and a full-matrix run adds the ones not yet seen.
NUMERIC = "float32 rounding: a group's gradient further from float64 than 4x torch float32's (BatchNorm over 2x2 maps)"
GPT2_CUT = "stage0: the forward half cannot produce /model/transformer/Gather_output_0"
KNOWN_FAILURES: dict[tuple, str] = {
    ("mobilenet_v3_small", "torchscript", "*", "*"): "stage 1: ORT has no gradient for op HardSwish",
    ("efficientnet_b0", "torchscript", "*", "*"): "stage 1 backward: operator com.microsoft.QuickGeluGrad (node ...) "
                                                   "has no portable form",
    ("shufflenet_v2_x0_5", "torchscript", "*", "*"): "cannot rewrite com.microsoft.ConvGrad (...): the spatial dims "
                                                      "of '/stage4/stage4.3/Reshape_1_output_0' must be fixed",
    ("gpt2_small", "torchscript", "*", 2): GPT2_CUT,
    ("gpt2_small", "torchscript", "*", 4): GPT2_CUT,
    ("resnet50", "torchscript", "training", "*"): NUMERIC + ": layer4.2.conv2 6.6e-2, torch 9.9e-5",
    ("regnet_x_400mf", "torchscript", "training", 2): NUMERIC + ": block4-1.f.a.0 2.3e-1, torch 1.5e-2",
    ("densenet121", "torchscript", "training", 2): NUMERIC + ": denselayer7.norm2 1.1e-1, torch 6.6e-3",
    ("lstm_classifier", "torchscript", "eval", "*"): "harness: the folded onnx::LSTM_* weights matched no torch "
                                                     "parameter element by element",
    ("gru_classifier", "torchscript", "eval", "*"): "harness: the folded onnx::GRU_* weights matched no torch "
                                                    "parameter element by element",
    ("*", "dynamo", "*", 2): "--stages 2 is more than the model's 1 blocks",
    ("*", "dynamo", "*", 4): "--stages 4 is more than the model's 1 blocks",
}


def matrix() -> list:
    full = os.environ.get(MATRIX_VARIABLE, "") == "full"
    cases = []
    for model in MODELS:
        for exporter in EXPORTERS:
            for mode in MODES:
                for stages in STAGES:
                    if not full and (exporter, mode, stages) != CI_SHARE:
                        continue
                    reason = known_failure(model, exporter, mode, stages)
                    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                    cases.append(pytest.param(model, exporter, mode, stages, marks=marks,
                                              id=f"{model}-{exporter}-{mode}-{stages}"))
    return cases


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(model, exporter, mode)``: the ONNX file, exported once per module."""
    folder, paths = tmp_path_factory.mktemp("torch-coverage"), {}

    def get(model: str, exporter: str, mode: str):
        if (model, exporter, mode) not in paths:
            paths[model, exporter, mode] = export_once(MODELS[model], exporter, mode, folder)
        return paths[model, exporter, mode]

    return get


@pytest.mark.parametrize(("model", "exporter", "mode", "stages"), matrix())
def test_loss_and_every_gradient_match_torch_autograd(exported, tmp_path, model, exporter, mode, stages):
    result = run_case(model, exporter, mode, stages, exported(model, exporter, mode), tmp_path)
    assert result.passed, result.verdict()
    assert result.compared == result.trained > 0


@pytest.mark.parametrize("model", SGD_MODELS)
def test_a_short_sgd_run_ends_where_torch_sgd_does(exported, tmp_path, model):
    """Three SGD steps (lr 0.01) on the same batches in the same order, 2 stages, against torch in float64."""
    exporter, mode, _ = CI_SHARE
    run = sgd_comparison(model, exported(model, exporter, mode), 2, tmp_path)
    assert run.loss_error <= ERROR_FLOOR and run.parameter_error <= ERROR_FLOOR, run


def test_a_graph_that_computes_something_else_fails_the_comparison(exported, tmp_path):
    """The harness can fail: the export's first ReLU made a LeakyReLU (0.1) no longer equals torch's model."""
    path = exported("squeezenet1_1", *CI_SHARE[:2])
    model = onnx.load(str(path))
    relu = next(node for node in model.graph.node if node.op_type == "Relu")
    relu.op_type = "LeakyRelu"
    relu.attribute.append(onnx.helper.make_attribute("alpha", 0.1))
    altered = tmp_path / "altered.onnx"
    onnx.save(model, str(altered))
    result = run_case("squeezenet1_1", *CI_SHARE[:2], 2, altered, tmp_path)
    assert not result.passed and result.largest_error > 1e-3, result.verdict()
    assert result.compared == result.trained  # every parameter was still matched: it is the numbers that differ


@pytest.mark.xfail(strict=True, raises=ModelLoadError,
                   reason="edgert reads the .onnx file alone: 'invalid ONNX graph: Data of TensorProto (tensor name: "
                          "...) should be stored in MODEL.onnx.data, but it doesn't exist'")
def test_the_dynamo_exporters_default_two_files_load(tmp_path):
    """torch's default exporter writes the weights beside the model (``external_data=True``): a user's first try."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    path = tmp_path / "mlp.onnx"
    torch.onnx.export(module, (torch.randn(2, 64),), str(path), dynamo=True,
                      dynamic_shapes=({0: torch.export.Dim("N", min=2, max=4096)},))
    assert (tmp_path / "mlp.onnx.data").exists()
    manifest = export_plan(path, tmp_path / "plan", ExportOptions(stages=1))
    assert len(manifest.stages) == 1
