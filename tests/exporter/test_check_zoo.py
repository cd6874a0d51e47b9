"""Every zoo model, cut into 1..4 stages, trains like the unsplit model (edgert check): its chained float32 stages
within float32's own error of the float64 unsplit model, its gradient formulas equal to central differences."""

import subprocess
import sys

import pytest

from edgert.exporter.check import FORMULA_TOLERANCE, check_plan
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
from edgert.exporter.source import from_model_proto
from edgert.models import build_model, list_models

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def zoo_sources():
    return {spec.name: from_model_proto(build_model(spec.name), f"{spec.name}.onnx") for spec in list_models()}


def export(source, folder, **options):
    options = ExportOptions(**options)
    analysis = prepare_analysis(source, options)
    return write_plan(source, analysis, choose_cuts(analysis, options), folder, options.training)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", [spec.name for spec in list_models()])
def test_chained_stages_match_unsplit_model(zoo_sources, tmp_path, name, stages):
    manifest = export(zoo_sources[name], tmp_path / "plan", stages=stages)
    assert len(manifest.stages) == stages
    report = check_plan(tmp_path / "plan", steps=3, batch_size=8)
    assert report.ok, report.to_json()
    assert report.formula_error <= FORMULA_TOLERANCE
    # the zoo is well conditioned: float32 lies close to float64, and so does the chain
    assert report.max_grad_rel_diff <= TOLERANCE and report.max_param_rel_diff <= TOLERANCE
    assert all(d.grad_floor <= TOLERANCE for d in report.stages)


def test_cut_across_a_skip_connection(zoo_sources, tmp_path):
    source = zoo_sources["resnet-mini"]
    options = ExportOptions(cuts=("res1b", "res2b"))
    analysis = prepare_analysis(source, options)
    cuts = choose_cuts(analysis, options)
    assert [len(analysis.cut_before(c).tensors) for c in cuts] == [2, 2]  # branch + skip
    manifest = write_plan(source, analysis, cuts, tmp_path / "plan", options.training)
    assert [len(s.inputs) for s in manifest.stages] == [1, 2, 2]
    assert all(len(s.input_gradients) == 2 for s in manifest.stages[1:])
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()


@pytest.mark.parametrize("optimizer", [dict(optimizer="sgd", learning_rate=0.05, momentum=0.9, weight_decay=1e-3),
                                       dict(optimizer="sgd", learning_rate=0.1)])
def test_sgd_steps_match_float64(zoo_sources, tmp_path, optimizer):
    from edgert.manifest import TrainingConfig

    training = TrainingConfig(**optimizer)
    export(zoo_sources["cnn"], tmp_path / "plan", stages=3, training=training)
    report = check_plan(tmp_path / "plan", steps=4)
    assert report.ok, report.to_json()
    assert report.max_param_rel_diff <= TOLERANCE


def test_a_wrong_gradient_rule_fails_the_check(zoo_sources, tmp_path, monkeypatch):
    """One rule broken (Relu's gradient 1% too large) fails check on the formulas, exported plan and all."""
    from edgert.exporter.gradients import registry
    from edgert.exporter.gradients.elementwise import relu

    def broken(context):
        right = relu(context)
        return {0: context.writer.op("Mul", [right[0], context.scalar_like(1.01, context.input(0))])}

    monkeypatch.setitem(registry.RULES, ("", "Relu"), registry.GradientRule(broken, (0,)))
    export(zoo_sources["cnn"], tmp_path / "plan", stages=2)
    report = check_plan(tmp_path / "plan", steps=1)
    assert not report.ok
    assert report.formula_error > 100 * FORMULA_TOLERANCE


def test_host_tools_need_no_torch(tmp_path):
    """Export and check import no torch (CI's host has none before its torch step)."""
    script = f"""
import sys
from pathlib import Path
class WithoutTorch:  # every finder, blind to torch: as on a host without it
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch" or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)
sys.meta_path[:] = [WithoutTorch(finder) for finder in sys.meta_path]
import onnxruntime  # imported directly first, as a test module or a user script may do
from edgert.exporter.check import check_plan
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
from edgert.exporter.source import from_model_proto
from edgert.models import build_model
source = from_model_proto(build_model("mlp"), "mlp.onnx")
options = ExportOptions(stages=2)
analysis = prepare_analysis(source, options)
write_plan(source, analysis, choose_cuts(analysis, options), Path({str(tmp_path / "plan")!r}), options.training)
print(check_plan({str(tmp_path / "plan")!r}, steps=1, batch_size=4).max_grad_rel_diff)
assert "torch" not in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) <= TOLERANCE
