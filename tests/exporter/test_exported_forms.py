"""What other exporters write: initializers merged by value (parameters of their own again), tensors computed
from constants alone (computed at export, not sent between stages), x[:, -1] (a Gather with a scalar index)."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from edgert.chain import StageChain
from edgert.exporter.check import check_plan
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.normalise import normalise
from edgert.exporter.source import from_model_proto
from tests.conftest import make_skip_model


def _merged_by_value():
    """The skip model as torch.onnx.export with constant folding writes it when a.bias and c.bias are equal
    (both zero): one initializer, read through a chain of Identity nodes."""
    model = make_skip_model()
    graph = model.graph
    biases = {i.name: i for i in graph.initializer}
    zeros = np.zeros(6, np.float32)
    biases["a.bias"].CopyFrom(numpy_helper.from_array(zeros, "a.bias"))
    graph.initializer.remove(biases["c.bias"])
    identities = [helper.make_node("Identity", ["a.bias"], ["onnx::Gemm_7"], name="Identity_0"),
                  helper.make_node("Identity", ["onnx::Gemm_7"], ["c.bias"], name="Identity_1")]
    nodes = identities + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


def test_identity_of_an_initializer_becomes_a_parameter_of_its_own():
    trainable = normalise(from_model_proto(_merged_by_value()))
    assert "c.bias" in trainable.parameters and "a.bias" in trainable.parameters
    assert "onnx::Gemm_7" not in trainable.parameters  # no node reads it any more
    assert not [n for n in trainable.graph.node if n.op_type == "Identity"]
    assert any("2 initializer(s) the exporter had merged" in note for note in trainable.notes)


def test_merged_parameters_on_both_sides_of_a_cut_train_apart(tmp_path):
    path = tmp_path / "merged.onnx"
    onnx.save(_merged_by_value(), str(path))
    manifest = export_plan(path, tmp_path / "plan", ExportOptions(cuts=("c",)))
    owners = {p.name: s.index for s in manifest.stages for p in s.parameters if p.trainable}
    assert owners["a.bias"] == 0 and owners["c.bias"] == 1
    report = check_plan(tmp_path / "plan")
    assert report.ok and report.max_grad_rel_diff <= 1e-4, report.to_json()
    chain = StageChain(tmp_path / "plan")
    rng = np.random.default_rng(0)
    chain.train_batch({"input": rng.standard_normal((8, 4)).astype(np.float32)},
                      {manifest.labels[0].name: rng.integers(0, 3, (8,))})
    chain.step()
    trained = chain.parameters()
    assert not np.array_equal(trained["a.bias"], trained["c.bias"])


def _last_step_model():
    """input[N,5,4] -> MatMul + Add -> x[:, -1] (Gather, scalar index, axis 1) -> Gemm -> logits[N,3]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "lin.weight"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "lin.bias"),
             numpy_helper.from_array(np.array(-1, np.int64), "last"),
             numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "head.weight")]
    nodes = [helper.make_node("MatMul", ["input", "lin.weight"], ["m"], name="/lin/MatMul"),
             helper.make_node("Add", ["m", "lin.bias"], ["h"], name="/lin/Add"),
             helper.make_node("Gather", ["h", "last"], ["last_step"], name="/Gather", axis=1),
             helper.make_node("Gemm", ["last_step", "head.weight"], ["logits"], name="/head/Gemm")]
    graph = helper.make_graph(nodes, "last", [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT,
                                                                            ["N", 5, 4])],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_the_last_step_of_a_sequence_trains(tmp_path):
    """x[:, -1], as torch exports it: a Gather with a scalar index, whose gradient has the axis dropped."""
    path = tmp_path / "last.onnx"
    onnx.save(_last_step_model(), str(path))
    export_plan(path, tmp_path / "plan", ExportOptions())
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()


def _constant_subgraph_model(domain: str = ""):
    """The skip model plus a tensor computed from constants alone in block a and used in block c (a mask, say)."""
    model = make_skip_model()
    graph = model.graph
    op = "Relu" if domain == "" else "Gelu"
    made = [helper.make_node("Constant", [], ["k"], name="/a/Constant",
                             value=numpy_helper.from_array(np.linspace(-1, 1, 6).astype(np.float32))),
            helper.make_node(op, ["k"], ["mask"], name=f"/a/{op}", domain=domain)]
    used = [helper.make_node("Add", ["c_out", "mask"], ["c_masked"], name="/c/AddMask")]
    nodes = list(graph.node)
    nodes[1:1] = made
    nodes.insert(nodes.index(next(n for n in nodes if n.name == "/c/Add")) + 1, used[0])
    next(n for n in nodes if n.name == "/d/Gemm").input[0] = "c_masked"
    del graph.node[:]
    graph.node.extend(nodes)
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return model


def test_a_tensor_computed_from_constants_is_computed_at_export_not_sent(tmp_path):
    path = tmp_path / "mask.onnx"
    onnx.save(_constant_subgraph_model(), str(path))
    trainable = normalise(from_model_proto(_constant_subgraph_model()))
    assert "mask" in {i.name for i in trainable.graph.initializer}
    manifest = export_plan(path, tmp_path / "plan", ExportOptions(cuts=("c",)))
    assert "mask" not in {t.name for t in manifest.stages[0].outputs}
    report = check_plan(tmp_path / "plan")
    assert report.ok, report.to_json()


def test_a_constant_tensor_that_cannot_be_computed_makes_its_cuts_illegal():
    """A contrib op is not computed at export: a cut it would cross is refused, saying why, and not chosen."""
    from edgert.exporter.analyse import analyse
    from edgert.exporter.cuts import balanced_cuts, resolve_cuts
    from edgert.exporter.errors import CutError

    analysis = analyse(normalise(from_model_proto(_constant_subgraph_model("com.microsoft"))))
    assert [c.legal for c in analysis.cuts] == [False, False, True]
    with pytest.raises(CutError, match="would carry mask, computed from constants alone"):
        resolve_cuts(analysis, ["c"])
    assert balanced_cuts(analysis, 2) == [3]
