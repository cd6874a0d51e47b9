"""Op features of the zoo's blocks and stages."""

import numpy as np
import pytest

from edgert.exporter.errors import PredictorError
from edgert.exporter.export import ExportOptions, prepare_analysis
from edgert.exporter.predictor.features import CATEGORIES, COLUMNS, design_row
from edgert.exporter.predictor.latency import Features, block_features, join_features, stage_features
from edgert.exporter.source import from_model_proto
from edgert.models import build_model


@pytest.fixture(scope="module")
def analyses():
    return {name: prepare_analysis(from_model_proto(build_model(name), f"{name}.onnx"), ExportOptions())
            for name in ("cnn", "resnet-mini", "mobilenet-mini", "transformer-mini")}


def test_joined_blocks_equal_the_stage(analyses):
    for analysis in analyses.values():
        blocks = block_features(analysis)
        count = len(blocks)
        for first, end in [(0, count), (1, count - 1), (0, 1), (count - 1, count), (2, 4)]:
            assert join_features(blocks[first:end]) == stage_features(analysis, first, end)


def test_flops_by_category_add_up_to_the_block(analyses):
    analysis = analyses["cnn"]
    for block, features in zip(analysis.blocks, block_features(analysis)):
        views = sum(1 for op in block.op_types if op == "Flatten")
        assert features.flops <= block.flops
        if not views:
            assert features.flops == block.flops
        assert features.nodes == len(block.nodes)
        assert features.param_bytes == block.param_bytes
    conv1 = block_features(analysis)[0]
    assert conv1.conv > 0 and conv1.norm > 0 and conv1.matmul == 0 and conv1.grad_in_bytes == 0
    assert conv1.tensors == 5  # conv weight, BN scale and bias, BN running mean and variance


def test_ops_land_in_their_category(analyses):
    mobilenet = dict(zip([b.name for b in analyses["mobilenet-mini"].blocks],
                         block_features(analyses["mobilenet-mini"])))
    assert mobilenet["ds1"].dwconv > 0 and mobilenet["ds1"].conv > 0 and mobilenet["stem"].dwconv == 0
    assert mobilenet["ds1"].gemm_calls == 16 + 1  # 16 depthwise groups + the pointwise conv, per image
    assert mobilenet["ds4"].conv_padding > 0 and mobilenet["ds1"].conv_padding == 0  # 2x2 vs 8x8 pixels
    transformer = dict(zip([b.name for b in analyses["transformer-mini"].blocks],
                           block_features(analyses["transformer-mini"])))
    assert transformer["embed"].gather > 0 and transformer["attn1"].reduce > 0
    assert transformer["attn1"].gemm_calls == 2 * 2  # scores and context, 2 heads each
    assert transformer["head"].out_bytes == 4 * 4  # 4 logits per sample


def test_skip_connections_count_in_the_boundary(analyses):
    resnet = analyses["resnet-mini"]
    index = [b.name for b in resnet.blocks].index("res1b")
    features = block_features(resnet)[index]
    assert features.grad_in_bytes == resnet.cut_before(index).bytes_per_sample  # branch + skip


def test_design_row_scales_per_sample_terms_with_the_micro_batch():
    f = Features(nodes=3, tensors=2, param_bytes=2_000_000, conv=1e6, activation_bytes=500_000, out_bytes=100)
    small, large = design_row(f, 2), design_row(f, 8)
    per_call = [COLUMNS.index(c) for c in ("call", "nodes", "tensors", "param_bytes")]
    assert np.array_equal(small[per_call], large[per_call]) and small[0] == 1 and small[2] == 2.0
    per_sample = [COLUMNS.index(c) for c in (*CATEGORIES, "activation_bytes", "boundary_bytes")]
    assert np.allclose(large[per_sample], 4 * small[per_sample])
    assert small[COLUMNS.index("conv")] == 2.0  # MFLOP x micro-batch


def test_features_round_trip_and_bad_ranges(analyses):
    features = block_features(analyses["cnn"])[1]
    assert Features.from_json(features.to_json()) == features
    with pytest.raises(PredictorError, match=r"block range \[3, 3\) is empty"):
        stage_features(analyses["cnn"], 3, 3)
    with pytest.raises(PredictorError, match="at least one block"):
        join_features([])
