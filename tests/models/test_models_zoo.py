"""The zoo's models: valid opset-17 ONNX, runnable, seeded, named by block, documented."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgert.errors import EdgertError
from edgert.models import ModelSpec, build_model, get_model_spec, list_models, save_model
from edgert.models.errors import ModelBuildError, UnknownModelError

# Trainable parameters (frozen initializers excluded), as documented in docs/MODELS.md.
PARAMS = {
    "mlp": 21_386,
    "mlp-deep": 1_598_218,
    "cnn": 40_506,
    "resnet-mini": 77_754,
    "mobilenet-mini": 18_826,
    "transformer-mini": 18_820,
}
NAMES = list(PARAMS)
NODE_NAME = re.compile(r"^/(?P<block>[a-z0-9_]+)/(?:[a-z0-9_]+/)?[A-Z][A-Za-z]*(?:_\d+)?$")
INITIALIZER_NAME = re.compile(r"^(?P<block>[a-z0-9_]+)\.[a-z0-9_]+\.[a-z0-9_]+$")


@pytest.fixture(scope="module", params=NAMES)
def built(request: pytest.FixtureRequest) -> tuple[ModelSpec, onnx.ModelProto]:
    return get_model_spec(request.param), build_model(request.param, seed=0)


def _props(model: onnx.ModelProto) -> dict[str, str]:
    return {prop.key: prop.value for prop in model.metadata_props}


def _block(node: onnx.NodeProto) -> str:
    return node.name.split("/")[1]


def _sample(spec: ModelSpec, batch: int) -> np.ndarray:
    rng = np.random.default_rng(batch)
    if spec.input_dtype == "int64":
        return rng.integers(0, spec.vocab_size, size=(batch, *spec.input_shape), dtype=np.int64)
    return rng.random((batch, *spec.input_shape), dtype=np.float32)


def test_registry_lists_every_model_in_documented_order() -> None:
    assert [spec.name for spec in list_models()] == NAMES


def test_model_passes_full_checker_at_opset_17_ir_8(built) -> None:
    _, model = built
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert {node.domain for node in model.graph.node} == {""}
    assert not {"Dropout", "Shape", "Size"} & {node.op_type for node in model.graph.node}


def test_graph_io_follows_the_spec(built) -> None:
    spec, model = built
    (graph_input,) = model.graph.input
    (graph_output,) = model.graph.output
    assert graph_input.name == spec.input_name == "input"
    assert graph_output.name == spec.output_name == "logits"
    dims = graph_input.type.tensor_type.shape.dim
    assert dims[0].dim_param == "N"
    assert tuple(d.dim_value for d in dims[1:]) == spec.input_shape
    expected = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(spec.input_dtype))
    assert graph_input.type.tensor_type.elem_type == expected


@pytest.mark.parametrize("batch", [1, 7])
def test_model_runs_in_onnxruntime(built, batch: int) -> None:
    spec, model = built
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input": _sample(spec, batch)})
    assert logits.shape == (batch, spec.num_classes)
    assert logits.dtype == np.float32
    assert np.all(np.isfinite(logits))


def test_trainable_parameter_count(built) -> None:
    spec, model = built
    frozen = set(filter(None, _props(model)["edgert.frozen"].split(",")))
    count = sum(
        int(np.prod(init.dims)) for init in model.graph.initializer if init.name not in frozen
    )
    assert count == PARAMS[spec.name]
    assert 10_000 <= count <= (2_000_000 if spec.name == "mlp-deep" else 200_000)  # the benchmarks' model is larger


def test_same_seed_same_bytes_other_seed_other_weights() -> None:
    for name in NAMES:
        first = build_model(name, seed=3)
        assert first.SerializeToString() == build_model(name, seed=3).SerializeToString()
        other = build_model(name, seed=4)
        assert [n.name for n in other.graph.node] == [n.name for n in first.graph.node]
        weights = {i.name: onnx.numpy_helper.to_array(i) for i in first.graph.initializer}
        changed = [
            i.name
            for i in other.graph.initializer
            if not np.array_equal(weights[i.name], onnx.numpy_helper.to_array(i))
        ]
        assert any(name.endswith(".weight") for name in changed), name


def test_node_and_initializer_names_follow_the_block_convention(built) -> None:
    _spec, model = built
    for node in model.graph.node:
        assert NODE_NAME.match(node.name), node.name
    block_of_consumer: dict[str, set[str]] = {}
    for node in model.graph.node:
        for tensor in node.input:
            block_of_consumer.setdefault(tensor, set()).add(_block(node))
    for init in model.graph.initializer:
        match = INITIALIZER_NAME.match(init.name)
        assert match, init.name
        assert block_of_consumer[init.name] == {match["block"]}, init.name
    names = [t.name for t in model.graph.input] + [t.name for t in model.graph.initializer]
    names += [out for node in model.graph.node for out in node.output]
    assert len(names) == len(set(names))
    assert len({node.name for node in model.graph.node}) == len(model.graph.node)


def test_blocks_are_contiguous_runs_in_spec_order(built) -> None:
    spec, model = built
    runs = [_block(node) for node in model.graph.node]
    order = [block for i, block in enumerate(runs) if i == 0 or runs[i - 1] != block]
    assert order == list(spec.blocks)  # each block once, so contiguous
    assert _props(model)["edgert.blocks"] == ",".join(spec.blocks)


def test_cuts_crossed_by_a_skip_are_the_documented_ones(built) -> None:
    spec, model = built
    position = {block: i for i, block in enumerate(spec.blocks)}
    produced_in = {t.name: -1 for t in model.graph.input}
    for node in model.graph.node:
        produced_in.update({out: position[_block(node)] for out in node.output})
    crossing: dict[int, set[str]] = {i: set() for i in range(len(spec.blocks) - 1)}
    for node in model.graph.node:
        for tensor in node.input:
            if tensor in produced_in:
                for cut in range(produced_in[tensor], position[_block(node)]):
                    if cut >= 0:
                        crossing[cut].add(tensor)
    assert all(crossing.values())  # every cut is crossed by at least the main path
    multi = {(spec.blocks[c], spec.blocks[c + 1]) for c, ts in crossing.items() if len(ts) > 1}
    assert multi == set(spec.skip_cuts)


def test_metadata_props_carry_the_training_defaults(built) -> None:
    spec, model = built
    props = _props(model)
    assert props["edgert.model"] == spec.name
    assert props["edgert.loss"] == "cross_entropy"
    assert props["edgert.dataset"] == spec.dataset
    assert props["edgert.dataset"] in {"digits-flat", "digits-image", "tokens"}
    assert props["edgert.num_classes"] == str(spec.num_classes)
    assert props["edgert.label"] == "labels"
    assert props["edgert.seed"] == "0"
    initializers = {init.name for init in model.graph.initializer}
    assert set(filter(None, props["edgert.frozen"].split(","))) <= initializers


def test_resnet_has_a_projection_shortcut_and_mobilenet_depthwise_convs() -> None:
    resnet = build_model("resnet-mini")
    assert any(node.name == "/res2b/proj_conv/Conv" for node in resnet.graph.node)
    mobilenet = build_model("mobilenet-mini")
    groups = [
        attr.i
        for node in mobilenet.graph.node
        if node.op_type == "Conv"
        for attr in node.attribute
        if attr.name == "group"
    ]
    assert {16, 32, 64} <= set(groups)
    assert all(node.op_type != "Relu" for node in mobilenet.graph.node)


def test_unknown_model_lists_the_known_names() -> None:
    with pytest.raises(UnknownModelError) as caught:
        get_model_spec("resnet-50")
    assert isinstance(caught.value, EdgertError)
    assert "'resnet-50'" in str(caught.value)
    for name in NAMES:
        assert name in str(caught.value)


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_bad_seed_is_refused_with_its_value(seed: object) -> None:
    with pytest.raises(ModelBuildError, match=re.escape(repr(seed))):
        build_model("mlp", seed=seed)  # type: ignore[arg-type]


def test_save_model_round_trips(tmp_path) -> None:
    model = build_model("cnn", seed=1)
    path = save_model(model, tmp_path / "zoo" / "cnn.onnx")
    assert onnx.load(str(path)).SerializeToString() == model.SerializeToString()


def test_importing_the_package_does_not_import_onnx() -> None:
    code = (
        "import sys, edgert.models, edgert.models.datasets, edgert.models.errors\n"
        "edgert.models.list_models(); edgert.models.get_model_spec('mlp')\n"
        "loaded = sorted(m for m in ('onnx', 'onnxruntime', 'sklearn') if m in sys.modules)\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
