"""BatchNorm in a group: a member normalises its rows with its own rows' batch statistics, and at every optimizer
step the members' running statistics are replaced by their mean weighted by each member's rows of the step."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edgert.coordinator.localcluster import LocalCluster
from edgert.groups import StageGroup
from edgert.manifest import TrainingConfig, load_manifest
from edgert.protocol import (
    ACT,
    BATCH,
    GRAD,
    GROUP_GRAD,
    GROUP_GRAD_KIND,
    RUN,
    STAGE,
    WEIGHTS,
    Peers,
    Segment,
    StageAssignment,
)
from edgert.run_settings import RunSettings
from edgert.stage import StageSession
from edgert.transport import ClientConfig, Envelope, TensorClient
from edgert.weights import StageState
from tests.hand_driven_worker import StandIn, end_hand_driven_run
from tests.zoo_plans import zoo_plan

pytestmark = pytest.mark.timeout(300)

RUN_ID = "group-bn"
BATCH_SIZE, MICRO_BATCHES = 16, 2  # micro-batches of 8 rows; shares 0.75 / 0.25: member 1 owns rows 6-7 of each


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return zoo_plan(tmp_path_factory.mktemp("plan"), 3, "cnn")


async def member_step(worker: str, plan, training: TrainingConfig, inputs, gradients, others) -> dict:
    """Stage 0 of the cnn (Conv, BatchNorm, Relu) as member 1 of a group of 2 for one gpipe step; the stand-in
    plays member 0 (sending ``others``: its gradient and running statistics), the coordinator and stage 1."""
    stand_in = StandIn()
    await stand_in.server.start()
    other = stand_in.server.urls[0]
    client = TensorClient(ClientConfig(timeout=60.0, retries=0))
    entry = load_manifest(plan).stages[0]
    files = {a.role: (plan / a.path).read_bytes() for a in entry.artifacts}
    assignment = StageAssignment(run_id=RUN_ID, entry=entry, stages=3, peers=Peers(None, other, other),
                                 settings=RunSettings(training, wait_timeout=60.0, replicate_every=0, central_every=0),
                                 group=StageGroup((other, worker), (0.75, 0.25)), member=1)
    try:
        await client.put(worker, STAGE, assignment.to_envelope(files))
        await client.send(worker, RUN, Segment("gpipe", 3, 0, 1, BATCH_SIZE, MICRO_BATCHES).to_envelope(RUN_ID))
        await client.send(worker, BATCH, Envelope(kind="batch", run_id=RUN_ID, step=0,
                                                  tensors={"input": np.concatenate(inputs)}))
        sent = await stand_in.wait(ACT, MICRO_BATCHES)
        assert sorted((e.microbatch, e.meta["row"]) for e in sent) == [(0, 6), (1, 6)]
        for m, gradient in enumerate(gradients):
            await client.send(worker, GRAD, Envelope(kind="gradients", run_id=RUN_ID, step=0, microbatch=m, stage=0,
                                                     tensors={entry.outputs[0].name: gradient}, meta={"row": 6}))
        (mine,) = await stand_in.wait(GROUP_GRAD, 1)
        await client.send(worker, GROUP_GRAD, Envelope(kind=GROUP_GRAD_KIND, run_id=RUN_ID, step=0, stage=0,
                                                       meta={"member": 0}, tensors=others))
        before = dict(mine.tensors)
        for _ in range(200):
            after = StageState.from_envelope((await client.get(worker, WEIGHTS)).envelope()).parameters
            if not np.array_equal(after["conv1.bn.running_mean"], before["conv1.bn.running_mean"]):
                break
            await asyncio.sleep(0.05)
        return {"sent": before, "after": after}
    finally:
        await end_hand_driven_run(client, worker, stand_in.server)


def test_a_member_sees_its_own_rows_statistics_and_the_group_averages_the_running_ones_by_rows(plan):
    rng = np.random.default_rng(3)
    entry = load_manifest(plan).stages[0]
    training = TrainingConfig(optimizer="sgd", learning_rate=0.1)
    inputs = [rng.standard_normal((2, 1, 8, 8)).astype(np.float32) for _ in range(MICRO_BATCHES)]  # rows 6-7 each
    gradients = [rng.standard_normal((2, 16, 8, 8)).astype(np.float32) for _ in range(MICRO_BATCHES)]
    # what a member's share sees: one stage on its own rows only (a real ORT session, as the worker runs it)
    alone = StageSession(entry, plan, training)
    for x, g in zip(inputs, gradients):
        alone.train_micro_batch({"input": x}, output_gradients={entry.outputs[0].name: g})
    own = alone.running_statistics()
    others = {"gradient": rng.standard_normal(alone.gradient_flat().shape).astype(np.float32),
              "conv1.bn.running_mean": rng.standard_normal(16).astype(np.float32),
              "conv1.bn.running_var": rng.uniform(0.5, 2.0, 16).astype(np.float32)}
    with LocalCluster(1) as cluster:
        result = asyncio.run(member_step(cluster.urls[0], plan, training, inputs, gradients, others))
    for name, value in own.items():
        # the member's running statistics moved by its own rows' batch statistics, exactly as a stage on those rows
        np.testing.assert_allclose(result["sent"][name], value, rtol=1e-6, atol=1e-7)
        # the group's: member 0 had 12 of the step's 16 rows, member 1 4
        np.testing.assert_allclose(result["after"][name], 0.75 * others[name] + 0.25 * value, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(result["sent"]["gradient"], alone.gradient_flat(), rtol=1e-5, atol=1e-6)
