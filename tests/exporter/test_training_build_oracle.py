"""edgert's gradients against the ONNX Runtime training build's: every zoo model stage by stage, every rule's case.

The training build is a test oracle only (the ``reference`` extra: x86-64, CPython 3.11/3.12, never beside stock
onnxruntime); CI runs this file in an environment of its own (.ci/run, "the gradient oracle").
"""

import subprocess
import sys

import numpy as np
import pytest

from edgert.ort_import import training_folder

pytestmark = [
    pytest.mark.training_build,
    pytest.mark.skipif(training_folder() is None, reason="needs the training build: pip install -e '.[reference]'"),
]

TOLERANCE = 1e-5  # the builder's float32 gradients against the training build's (both float32, relative)
# Cases the training build (ORT 1.19.2, CPU) cannot serve as a reference for; central differences check them
# (tests/exporter/test_gradient_rules.py).
NO_GRADIENT = {  # "no gradient registered" for the operator, or for this form of it
    "hard_swish", "hard_sigmoid", "mish", "softsign", "celu", "selu", "elu", "softplus", "prelu", "gelu_exact",
    "gelu_tanh", "sin", "cos", "abs", "erf", "reciprocal", "log", "exp", "sqrt", "pow_both", "pow_constant", "max_two",
    "min_broadcast", "mean_two", "sum_three", "reduce_max", "reduce_min", "reduce_l2", "reduce_log_sum_exp",
    "reduce_sum_square", "global_max_pool", "instance_norm", "cumsum", "cumsum_reverse_exclusive", "trilu",
    "einsum_attention", "einsum_summed_away", "gather_elements", "gather_nd", "scatter_nd", "scatter_elements",
    "tile", "pad_constant", "pad_axes", "pad_computed", "cast_like", "clip", "clip_min_only",
    "layernorm_no_stat_outputs", "softmax_cross_entropy", "softmax_cross_entropy_sum",
    "softmax_cross_entropy_weighted",  # it needs the statistics / log-probabilities as outputs
}
BROKEN = {  # its gradient graph fails to build or to run, crashes the session, or computes other numbers
    "mul_same", "matmul_vector_left", "matmul_vector_right", "split_one_output_used", "where", "conv_same_upper",
    "conv_same_lower", "slice_negative_steps", "conv_transpose", "conv_transpose_grouped", "average_pool",
    "average_pool_pads", "average_pool_count_pads", "average_pool_ceil", "max_pool", "max_pool_overlap",
}


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("name", ["mlp", "mlp-deep", "cnn", "resnet-mini", "mobilenet-mini", "transformer-mini"])
def test_every_zoo_stage_equals_the_training_builds(tmp_path, name, stages):
    """Each stage's gradients (parameters, boundary inputs) and running statistics, in both memory modes."""
    from edgert.exporter.check import check_plan
    from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
    from edgert.exporter.source import from_model_proto
    from edgert.models import build_model

    source = from_model_proto(build_model(name), f"{name}.onnx")
    options = ExportOptions(stages=stages)
    analysis = prepare_analysis(source, options)
    write_plan(source, analysis, choose_cuts(analysis, options), tmp_path / "plan", options.training)
    report = check_plan(tmp_path / "plan", steps=1, reference="training-build")
    assert sorted((c.stage, c.memory_mode) for c in report.training_build) == sorted(
        [(k, "recompute") for k in range(stages)] + [(k, "stash") for k in range(stages - 1)])
    assert max(c.largest for c in report.training_build) <= TOLERANCE, report.to_json()
    assert report.ok, report.to_json()


def _cases():
    from tests.exporter.test_gradient_rules import CASES

    return sorted(name for name in CASES if name not in NO_GRADIENT | BROKEN)


@pytest.mark.parametrize("case", _cases())
def test_a_rules_gradient_equals_the_training_builds(case):
    from edgert.exporter.ort_training import gradient_graph
    from tests.exporter.gradient_cases import gradient_model, params_as_inputs, random_feeds, run_ort
    from tests.exporter.test_gradient_rules import CASES

    model, wanted = CASES[case]
    params = {i.name for i in model.graph.initializer} & wanted
    feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in random_feeds(model, 2).items()}
    ours = run_ort(gradient_model(model, wanted, params), feeds)
    theirs = run_ort(gradient_graph(params_as_inputs(model, params), "loss", wanted), feeds)
    for name in wanted:
        expected = theirs[f"{name}_grad"]
        scale = max(float(np.max(np.abs(expected))), 1e-12)
        assert float(np.max(np.abs(ours[f"{name}_grad"] - expected))) / scale <= TOLERANCE, name


def test_the_training_api_imports_without_torch():
    script = ("import sys\nfrom edgert.exporter.ort_training import training_api\ntraining_api()\n"
              "assert 'torch' not in sys.modules\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
