"""Analysis: blocks, FLOPs, parameter bytes and the tensors crossing each cut."""

import itertools

import pytest

from edgert.exporter.analyse import analyse
from edgert.exporter.cuts import balanced_cuts, resolve_cuts, stage_cost
from edgert.exporter.errors import CutError
from edgert.exporter.normalise import normalise
from edgert.exporter.source import from_model_proto
from tests.conftest import make_skip_model


def analysed(model=None, **kwargs):
    return analyse(normalise(from_model_proto(model or make_skip_model())), **kwargs)


def test_blocks_follow_name_scopes():
    analysis = analysed()
    assert [b.name for b in analysis.blocks] == ["a", "b", "c", "d"]
    assert analysis.blocks[2].nodes == ("/c/Gemm", "/c/Add")
    assert analysis.blocks[0].params == ("a.weight", "a.bias")
    assert analysis.blocks[0].param_bytes == (4 * 6 + 6) * 4
    assert analysis.blocks[1].params == ()


def test_flops_count_multiply_accumulate_as_two():
    analysis = analysed()
    assert analysis.blocks[0].flops == 2 * 4 * 6 + 0  # Gemm: 2*K*N per sample (bias add folded in)
    assert analysis.blocks[1].flops == 6  # Relu: one per output element
    assert analysis.blocks[2].flops == 2 * 6 * 6 + 6


def test_skip_connection_makes_a_cut_carry_two_tensors():
    analysis = analysed()
    crossing = {c.before_block: [t.name for t in c.tensors] for c in analysis.cuts}
    assert crossing == {"b": ["a_out"], "c": ["a_out", "b_out"], "d": ["c_out"]}
    cut_c = analysis.cut_before(2)
    assert cut_c.bytes_per_sample == 2 * 6 * 4
    assert all(t.shape == ("N", 6) and t.dtype == "float32" for t in cut_c.tensors)


def test_prediction_and_inputs_are_described():
    analysis = analysed()
    assert analysis.output.name == "logits" and analysis.output.shape == ("N", 3)
    assert [t.name for t in analysis.inputs] == ["input"]
    assert analysis.param_count == 4 * 6 + 6 + 36 + 6 + 18 + 3


def test_parameter_used_on_both_sides_makes_cut_illegal():
    from onnx import helper

    model = make_skip_model()
    gemm_d = model.graph.node[4]
    gemm_d.input[0] = "d_in"
    # block d adds c.bias again before its Gemm: the cut before d would split c.bias
    model.graph.node.insert(4, helper.make_node("Add", ["c_out", "c.bias"], ["d_in"], name="/d/Add"))
    analysis = analysed(model)
    assert [c.before_block for c in analysis.cuts if not c.legal] == ["d"]
    assert analysis.cut_before(3).shared_params == ("c.bias",)
    with pytest.raises(CutError, match="would split parameter"):
        resolve_cuts(analysis, ["d"])
    assert balanced_cuts(analysis, 3) == [1, 2]


def test_balanced_cuts_are_optimal_against_brute_force():
    analysis = analysed()
    flops = [b.flops for b in analysis.blocks]
    for stages in range(1, len(flops) + 1):
        cuts = balanced_cuts(analysis, stages)
        assert len(cuts) == stages - 1

        def bottleneck(cut_list):
            bounds = [0, *cut_list, len(flops)]
            spans = list(zip(bounds, bounds[1:]))
            return max(stage_cost(sum(flops[a:b]), last=k == len(spans) - 1) for k, (a, b) in enumerate(spans))

        best = min(bottleneck(list(c)) for c in itertools.combinations(range(1, len(flops)), stages - 1))
        assert bottleneck(cuts) == best


def test_block_depth_can_be_forced():
    model = make_skip_model()
    for node in model.graph.node:
        node.name = "/net" + node.name  # everything under one top-level scope
    automatic = analysed(model)
    assert [b.name for b in automatic.blocks] == ["net/a", "net/b", "net/c", "net/d"]
    assert automatic.block_depth == 2
    assert [b.name for b in analysed(model, block_depth=1).blocks] == ["net"]
