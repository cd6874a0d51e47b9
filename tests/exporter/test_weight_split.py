"""The backward split in two (B/W): a step's parameter gradients computed once over all its micro-batches
equal those of one backward per micro-batch, in both memory modes; stages it cannot hold for keep one."""

import numpy as np
import onnx
import pytest

from edgert.chain import StageChain
from edgert.exporter.cuts import stage_cost
from edgert.exporter.export import ExportOptions, choose_cuts, prepare_analysis, write_plan
from edgert.exporter.source import from_model_proto
from edgert.exporter.weight_split import split_backward
from edgert.manifest import SPLIT_ROLES, TrainingConfig, split_roles
from edgert.models import build_model, get_model_spec, load_dataset
from edgert.stage import StageSession


def _plan(folder, name, stages=3):
    source = from_model_proto(build_model(name), f"{name}.onnx")
    training = TrainingConfig(learning_rate=3e-3)
    options = ExportOptions(stages=stages, training=training)
    analysis = prepare_analysis(source, options)
    return write_plan(source, analysis, choose_cuts(analysis, options), folder, training)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split")
    return {name: (folder / name, _plan(folder / name, name)) for name in ("mlp", "transformer-mini", "cnn")}


@pytest.mark.parametrize("memory_mode", ["recompute", "stash"])
@pytest.mark.parametrize("name", ["mlp", "transformer-mini", "cnn"])
def test_split_backward_trains_to_the_same_parameters(plans, name, memory_mode):
    folder, _ = plans[name]
    spec = get_model_spec(name)
    data = load_dataset(spec.dataset, spec)
    chains = {split: StageChain(folder, memory_mode=memory_mode, split_backward=split) for split in (False, True)}
    assert [stage.splits for stage in chains[True].stages] == [False, True, True]
    for step in range(3):
        x, y = data.x_train[step * 24:(step + 1) * 24], data.y_train[step * 24:(step + 1) * 24]
        losses = {split: chain.train_batch({"input": x}, {"labels": y}, micro_batches=3).loss
                  for split, chain in chains.items()}
        assert losses[True] == pytest.approx(losses[False], rel=1e-6)
        if step == 0:  # the same gradients, summed in another order (one call over the rows, not three)
            for whole, split in zip(chains[False].stages, chains[True].stages):
                expected, got = whole.gradients(), split.gradients()
                scale = max(float(np.max(np.abs(g))) for g in expected.values())
                for name in expected:
                    np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5 * scale, err_msg=name)
        for chain in chains.values():
            chain.step()
    whole, split = chains[False].parameters(), chains[True].parameters()
    for key in whole:  # Adam divides each update by its gradient's size: a rounding difference moves 1e-6 of 1e-2
        np.testing.assert_allclose(split[key], whole[key], rtol=1e-5, atol=2e-5, err_msg=key)


def test_which_stages_are_split(plans):
    """Every stage but the first (none of whose backward is waited for), in both memory modes: the zoo's weight
    gradients are sums over rows. A BatchNorm's stay with the input gradients, which need the same sums."""
    for name, (_, manifest) in plans.items():
        first, *others = manifest.stages
        assert not split_roles(first, "recompute") and not split_roles(first, "stash")
        for stage in others:
            modes = ("recompute",) if stage.is_last else ("recompute", "stash")
            assert all(split_roles(stage, mode) == SPLIT_ROLES[mode] for mode in modes), (name, stage.index)
    folder, cnn = plans["cnn"]
    weight = onnx.load(str(folder / cnn.stages[1].artifact("backward_weight").path))
    outputs = {o.name for o in weight.graph.output}
    assert outputs and not any(".bn." in name for name in outputs)


def test_a_split_session_defers_every_parameter_gradient_to_the_step(plans):
    folder, manifest = plans["mlp"]
    stage = manifest.stages[1]
    session = StageSession(stage, folder, manifest.training, split_backward=True)
    assert session.splits
    rng = np.random.default_rng(0)
    for _ in range(2):
        inputs = {t.name: t.sample(rng, 4) for t in stage.inputs}
        grads = {t.name: t.sample(rng, 4) for t in stage.outputs if t.name in stage.output_gradients}
        result = session.train_micro_batch(inputs, grads)
        assert set(result.input_gradients) == set(stage.input_gradients)
    assert session.finish_weights() == 8  # the two micro-batches' rows in one call
    assert session.finish_weights() == 0
    assert all(np.any(g) for g in session.gradients().values())


def test_a_weight_half_that_reads_a_per_call_scalar_is_not_split(plans):
    """Concatenating micro-batches is exact only for tensors with the batch first: a weight half reading the loss
    scale (one number per call) keeps its backward whole."""
    folder, manifest = plans["mlp"]
    last = manifest.stages[-1]
    backward = onnx.load(str(folder / last.artifact("backward").path))
    parameters = [p.name for p in last.parameters if p.trainable]
    assert split_backward(backward, parameters) is not None
    gradient = f"{parameters[0]}_grad"
    producer = next(node for node in backward.graph.node if gradient in node.output)
    scaled = f"{gradient}/scaled"
    producer.output[list(producer.output).index(gradient)] = scaled
    backward.graph.node.append(onnx.helper.make_node("Mul", [scaled, "loss_scale"], [gradient]))
    assert split_backward(backward, parameters) is None


def test_cuts_for_the_split_give_the_stages_after_the_first_more_blocks():
    """Their weight gradients leave the pipeline's path: balanced for it, the first stage takes fewer blocks."""
    source = from_model_proto(build_model("mlp-deep"), "mlp-deep.onnx")
    blocks = {}
    for split in (False, True):
        options = ExportOptions(stages=4, split_backward=split)
        analysis = prepare_analysis(source, options)
        bounds = [0, *choose_cuts(analysis, options), len(analysis.blocks)]
        blocks[split] = [end - start for start, end in zip(bounds, bounds[1:])]
    assert blocks[False] == [6, 6, 6, 8]  # 24 equal layers; the last stage's forward is folded into its backward
    assert blocks[True][0] < blocks[False][0] and sum(blocks[True]) == sum(blocks[False])
    assert stage_cost(10, last=False, first=True, split_backward=True) == stage_cost(10, last=False) == 40
    assert stage_cost(10, last=False, split_backward=True) == 30
    assert stage_cost(10, last=True, split_backward=True) == 20
