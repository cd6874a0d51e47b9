"""A non-last stage's backward starts from the next stage's gradients: the same outputs, fewer nodes."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from edgert.exporter import artifacts
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
from edgert.exporter.loss import SCALED_LOSS_OUTPUT
from edgert.exporter.source import from_model_proto
from edgert.exporter.stash import SEED
from edgert.exporter.vjp_seed import seed_from_gradients
from edgert.models import build_model

GRAPHS = ("backward", "backward_stash")


def _plan(folder, name, cuts):
    source = from_model_proto(build_model(name), f"{name}.onnx")
    options = ExportOptions(cuts=cuts)
    analysis = prepare_analysis(source, options)
    return write_plan(source, analysis, choose_cuts(analysis, options), folder, options.training)


def _run(model: onnx.ModelProto, rows: int, seed: int) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {i.name: rng.standard_normal([d if isinstance(d, int) else rows for d in i.shape]).astype(np.float32)
             for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


@pytest.fixture(scope="module", params=[("mlp", ("fc2", "fc3")), ("resnet-mini", ("res1b", "res2b"))],
                ids=["mlp", "resnet-mini-across-skips"])
def plans(request, tmp_path_factory):
    """The plan as exported, and the same plan exported without the seeding (the reference)."""
    name, cuts = request.param
    folder = tmp_path_factory.mktemp(name)
    seeded = _plan(folder / "seeded", name, cuts)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(artifacts, "seed_from_gradients", lambda model, gradients, keep=(): model)
        _plan(folder / "reference", name, cuts)
    return folder, seeded


@pytest.mark.parametrize("graph", GRAPHS)
def test_seeded_backward_computes_the_same_gradients_with_fewer_nodes(plans, graph):
    folder, manifest = plans
    for stage in manifest.stages[:-1]:
        seeded = onnx.load(str(folder / "seeded" / f"stage{stage.index}" / f"{graph}.onnx"))
        reference = onnx.load(str(folder / "reference" / f"stage{stage.index}" / f"{graph}.onnx"))
        assert [i.name for i in seeded.graph.input] == [i.name for i in reference.graph.input]
        assert [o.name for o in seeded.graph.output] == [o.name for o in reference.graph.output
                                                       if o.name != SCALED_LOSS_OUTPUT]
        assert SEED not in {init.name for init in seeded.graph.initializer}
        assert "Expand" not in {node.op_type for node in seeded.graph.node}
        assert len(seeded.graph.node) <= len(reference.graph.node) - 4 * len(stage.output_gradients)
        for rows in (1, 5):
            got, expected = _run(seeded, rows, stage.index), _run(reference, rows, stage.index)
            for name, value in got.items():
                np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_seed_other_than_one_keeps_its_product(plans):
    """The folding is exact only for a seed of 1: any other seed's graph keeps computing with it."""
    folder, manifest = plans
    stage = manifest.stages[0]
    reference = onnx.load(str(folder / "reference" / "stage0" / "backward.onnx"))
    for init in reference.graph.initializer:
        if init.name == SEED:
            init.CopyFrom(numpy_helper.from_array(np.array(2.0, np.float32), SEED))
    result = seed_from_gradients(reference, set(stage.output_gradients.values()))
    assert SEED in {init.name for init in result.graph.initializer}
    got, expected = _run(result, 3, 0), _run(reference, 3, 0)
    assert set(got) == set(expected) - {SCALED_LOSS_OUTPUT}
    for name, value in got.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-6, atol=1e-7, err_msg=name)
