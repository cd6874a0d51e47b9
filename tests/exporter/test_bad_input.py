"""Bad input gets one clear line naming the problem (exit code 2), never a traceback."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from edgert.cli import main
from tests.conftest import make_skip_model


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_not_onnx(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x00\x01garbage" * 100)
    assert_one_line_error(run("export", path, "-o", tmp_path / "plan"), "not an ONNX model")


def test_invalid_graph(tmp_path):
    model = make_skip_model()
    model.graph.node[2].op_type = "NoSuchOp"
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    assert_one_line_error(run("export", path, "-o", tmp_path / "plan"), "invalid ONNX graph", "NoSuchOp")


def test_unknown_cut_lists_the_legal_ones(skip_model_path, tmp_path):
    result = run("export", skip_model_path, "--cuts", "nowhere", "-o", tmp_path / "plan")
    assert_one_line_error(result, "cut 'nowhere': no such node or block",
                          "legal cuts: 1=b (after /a/Gemm), 2=c (after /b/Relu), 3=d (after /c/Add)")


def test_cut_by_node_name_inside_a_block(skip_model_path, tmp_path):
    result = run("export", skip_model_path, "--cuts", "/c/Gemm", "-o", tmp_path / "plan")
    assert_one_line_error(result, "inside block 'c'")


def test_cut_that_leaves_a_stage_empty(skip_model_path, tmp_path):
    assert_one_line_error(run("export", skip_model_path, "--cuts", "2,c", "-o", tmp_path / "plan"),
                          "name the same cut twice", "stage empty")
    assert_one_line_error(run("export", skip_model_path, "--cuts", "4", "-o", tmp_path / "plan"),
                          "would be empty")


def test_more_stages_than_blocks(skip_model_path, tmp_path):
    assert_one_line_error(run("export", skip_model_path, "--stages", "5", "-o", tmp_path / "plan"),
                          "more than the model's 4 blocks")


def test_op_without_gradient_names_op_and_node(tmp_path):
    model = make_skip_model()
    model.graph.node[1].op_type = "Atan"
    path = tmp_path / "atan.onnx"
    path.write_bytes(model.SerializeToString())
    assert_one_line_error(run("export", path, "--stages", "2", "-o", tmp_path / "plan"),
                          "no gradient rule for operator Atan", "node '/b/Relu'", "stage 0")


def test_explicit_cuts_by_index_block_and_node(skip_model_path, tmp_path):
    for spec in ("1,3", "b,d", "/a/Gemm,/c/Add"):
        result = run("export", skip_model_path, "--cuts", spec, "-o", tmp_path / spec.replace("/", "_"))
        assert result.exit_code == 0, result.output
        assert "wrote" in result.output


def test_check_and_inspect_work_from_the_cli(skip_model_path, tmp_path):
    plan = tmp_path / "plan"
    assert run("export", skip_model_path, "--stages", "3", "-o", plan).exit_code == 0
    inspected = run("inspect", plan)
    assert inspected.exit_code == 0 and "FLOPs/sample" in inspected.output and "c_out['N', 6]" in inspected.output
    checked = run("check", plan, "--json")
    assert checked.exit_code == 0
    report = json.loads(checked.output)
    assert report["ok"] and report["max_grad_rel_diff"] <= 1e-4 and "loss_diff" in report


def test_check_fails_with_exit_1_when_a_gradient_is_wrong(skip_model_path, tmp_path, monkeypatch):
    """A plan exported with one rule broken (Relu's gradient 1% too large) fails check, exit code 1."""
    from edgert.exporter.gradients import registry
    from edgert.exporter.gradients.elementwise import relu

    def broken(context):
        return {0: context.writer.op("Mul", [relu(context)[0], context.scalar_like(1.01, context.input(0))])}

    plan = tmp_path / "plan"
    with monkeypatch.context() as patched:
        patched.setitem(registry.RULES, ("", "Relu"), registry.GradientRule(broken, (0,)))
        assert run("export", skip_model_path, "--stages", "2", "-o", plan).exit_code == 0
    result = run("check", plan, "--steps", "1")
    assert result.exit_code == 1 and "FAIL" in result.output


def test_mse_loss(tmp_path):
    path = tmp_path / "regression.onnx"
    onnx.save(make_skip_model(), str(path))
    plan = tmp_path / "plan"
    result = run("export", path, "--stages", "2", "--loss", "mse", "-o", plan)
    assert result.exit_code == 0, result.output
    checked = run("check", plan, "--json")
    assert checked.exit_code == 0, checked.output


def _upsampling_model():
    """input[N,2,4,4] -> Conv -> Resize (x2, nearest) -> Flatten -> Gemm: edgert has no gradient rule for Resize."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 2, 3, 3)).astype(np.float32), "conv.weight"),
             numpy_helper.from_array(np.array([], np.float32), "roi"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
             numpy_helper.from_array(rng.standard_normal((3 * 8 * 8, 4)).astype(np.float32), "fc.weight")]
    nodes = [helper.make_node("Conv", ["input", "conv.weight"], ["c"], name="/conv/Conv", pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["c", "roi", "scales"], ["up"], name="/up/Resize", mode="nearest"),
             helper.make_node("Flatten", ["up"], ["flat"], name="/fc/Flatten"),
             helper.make_node("Gemm", ["flat", "fc.weight"], ["logits"], name="/fc/Gemm")]
    graph = helper.make_graph(nodes, "up", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 2, 4, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_an_operator_without_a_gradient_rule_fails_before_anything_is_written(tmp_path):
    path = tmp_path / "up.onnx"
    onnx.save(_upsampling_model(), str(path))
    result = run("export", path, "-o", tmp_path / "plan", "--stages", "2")
    assert_one_line_error(result, "no gradient rule for operator Resize", "/up/Resize", "stage 1")
    assert not (tmp_path / "plan").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["up.onnx"]  # no half-built stage folder left behind


def test_a_failed_export_leaves_the_previous_plan_as_it_was(skip_model_path, tmp_path):
    assert run("export", skip_model_path, "-o", tmp_path / "plan", "--stages", "2").exit_code == 0
    before = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "plan").rglob("*") if p.is_file()}
    path = tmp_path / "up.onnx"
    onnx.save(_upsampling_model(), str(path))
    assert_one_line_error(run("export", path, "-o", tmp_path / "plan"), "no gradient rule for operator Resize")
    after = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "plan").rglob("*") if p.is_file()}
    assert after == before


def test_zero_stages_is_refused(skip_model_path, tmp_path):
    assert_one_line_error(run("export", skip_model_path, "--stages", "0", "-o", tmp_path / "plan"),
                          "--stages must be at least 1 (got 0)")
    assert not (tmp_path / "plan").exists()


def _plan_with_damaged_source(tmp_path):
    """A plan whose source.onnx had one byte of its edgert.frozen metadata flipped (the file still parses)."""
    model = make_skip_model()
    model.metadata_props.add(key="edgert.frozen", value="d.bias")
    path = tmp_path / "frozen.onnx"
    onnx.save(model, str(path))
    plan = tmp_path / "plan"
    assert run("export", path, "--stages", "2", "-o", plan).exit_code == 0
    data = bytearray((plan / "source.onnx").read_bytes())
    data[data.rindex(b"d.bias")] ^= 0x20  # d.bias -> D.bias
    (plan / "source.onnx").write_bytes(bytes(data))
    return plan


def test_a_damaged_source_model_is_named_by_check_and_replanning(tmp_path):
    from edgert.exporter.errors import ModelLoadError
    from edgert.exporter.planner.replanner import Replanner
    from edgert.manifest import load_manifest

    plan = _plan_with_damaged_source(tmp_path)
    source = plan / "source.onnx"
    assert_one_line_error(run("check", plan), f"{source} is damaged or replaced", "source_sha256")
    with pytest.raises(ModelLoadError, match="is damaged or replaced") as raised:  # what `edgert train` re-plans from
        Replanner(plan, load_manifest(plan), tmp_path / "cache")
    assert str(source) in str(raised.value) and "--frozen" not in str(raised.value)


def test_frozen_names_from_the_models_metadata_are_not_blamed_on_the_option(tmp_path):
    plan = _plan_with_damaged_source(tmp_path)
    result = run("export", plan / "source.onnx", "-o", tmp_path / "again")
    assert_one_line_error(result, "source.onnx: the model's edgert.frozen metadata names no initializer: D.bias")
    assert_one_line_error(run("export", plan / "source.onnx", "--frozen", "nope", "-o", tmp_path / "again"),
                          "--frozen names no initializer: nope")


def test_a_parameter_that_does_not_reach_the_loss_says_to_freeze_it(tmp_path):
    from onnx import helper, numpy_helper

    model = make_skip_model()
    model.graph.initializer.append(numpy_helper.from_array(np.ones(6, np.float32), "unused.scale"))
    model.graph.node.insert(1, helper.make_node("Mul", ["a_out", "unused.scale"], ["dead"], name="/a/Mul"))
    path = tmp_path / "dead.onnx"
    onnx.save(model, str(path))
    assert_one_line_error(run("export", path, "-o", tmp_path / "plan"),
                          "parameter 'unused.scale' does not reach the loss", "--frozen unused.scale")
    assert run("export", path, "--frozen", "unused.scale", "-o", tmp_path / "plan").exit_code == 0


def test_frozen_initializers_stay_frozen_in_check_and_replanning(skip_model_path, tmp_path):
    from edgert.exporter.planner.replanner import Replanner
    from edgert.manifest import load_manifest

    plan = tmp_path / "plan"
    assert run("export", skip_model_path, "--stages", "2", "--frozen", "c.bias", "-o", plan).exit_code == 0
    manifest = load_manifest(plan)
    assert "c.bias" not in {p.name for s in manifest.stages for p in s.parameters}
    checked = run("check", plan, "--json")
    assert checked.exit_code == 0 and json.loads(checked.output)["ok"], checked.output
    assert "c.bias" not in Replanner(plan, manifest, tmp_path / "cache").analysis.trainable.parameters
