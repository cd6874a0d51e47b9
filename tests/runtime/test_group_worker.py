"""One member of a group on a real worker: it takes only its rows' pieces, sends its pieces to the owners of those
rows, sums its gradients with the other member's before the optimizer step, and refuses what is not its own."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from edgert.coordinator.localcluster import LocalCluster
from edgert.groups import StageGroup
from edgert.manifest import TrainingConfig, load_manifest
from edgert.protocol import (
    ACT,
    DATA_KINDS,
    GRAD,
    GROUP_GRAD,
    GROUP_GRAD_KIND,
    RUN,
    STAGE,
    STOP,
    WEIGHTS,
    Peers,
    Segment,
    StageAssignment,
)
from edgert.run_settings import RunSettings
from edgert.transport import ClientConfig, Envelope, TensorClient, TransportError
from edgert.weights import StageState
from tests.hand_driven_worker import StandIn, end_hand_driven_run
from tests.zoo_plans import zoo_plan

pytestmark = pytest.mark.timeout(300)

RUN_ID, LR = "group", 0.5


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return zoo_plan(tmp_path_factory.mktemp("plan"), 3, "mlp")


async def member_one_step(worker: str, plan) -> dict:
    """Stage 1 of 3 as member 1 of a group of 2 (shares 0.5 / 0.5) between two stages of one worker: one gpipe
    step of 2 micro-batches of 4 rows; member 1 owns rows 2-3 of each."""
    stand_in = StandIn()
    await stand_in.server.start()
    other = stand_in.server.urls[0]
    client = TensorClient(ClientConfig(timeout=60.0, retries=0))
    manifest = load_manifest(plan)
    entry = manifest.stages[1]
    files = {a.role: (plan / a.path).read_bytes() for a in entry.artifacts}
    training = TrainingConfig(optimizer="sgd", learning_rate=LR)
    assignment = StageAssignment(run_id=RUN_ID, entry=entry, stages=3,
                                 peers=Peers(other, other, other, next_codec="int8", previous_codec="fp16"),
                                 settings=RunSettings(training, wait_timeout=60.0, replicate_every=0,
                                                      central_every=0, backward_codec="int8"),
                                 group=StageGroup((other, worker), (0.5, 0.5)), member=1)
    rng = np.random.default_rng(0)
    (spec,), (out,) = entry.inputs, entry.outputs
    width, out_width = int(spec.shape[1]), int(out.shape[1])

    def piece(path: str, micro: int, row: int | None, rows: int = 2, tensors=None) -> Envelope:
        name, size = (spec.name, width) if path == ACT else (out.name, out_width)
        tensors = tensors or {name: rng.standard_normal((rows, size)).astype(np.float32)}
        return Envelope(kind=DATA_KINDS[path], run_id=RUN_ID, step=0, microbatch=micro, stage=1, tensors=tensors,
                        meta={} if row is None else {"row": row})

    async def status(path: str, envelope: Envelope) -> str:
        try:
            await client.send(worker, path, envelope)
            return "2.04"
        except TransportError as error:
            return f"{error.code.dotted} {error.diagnostic}"

    result: dict = {}
    try:
        await client.put(worker, STAGE, assignment.to_envelope(files))
        before = StageState.from_envelope((await client.get(worker, WEIGHTS)).envelope()).parameters
        await client.send(worker, RUN, Segment("gpipe", 3, 0, 1, 8, 2).to_envelope(RUN_ID))
        result["no_row"] = await status(ACT, piece(ACT, 0, None))
        result["not_its_rows"] = await status(ACT, piece(ACT, 0, 0))
        result["wrong_size"] = await status(ACT, piece(ACT, 0, 2, rows=3))
        inputs = [piece(ACT, m, 2) for m in range(2)]
        for envelope in inputs:
            result.setdefault("inputs", []).append(await status(ACT, envelope))
        sent = await stand_in.wait(ACT, 2)
        result["act_rows"] = sorted((e.microbatch, e.meta.get("row"), e.tensors[out.name].shape[0]) for e in sent)
        result["act_codecs"] = {codec for e in sent for codec in e.codecs.values()}
        for m in range(2):
            result.setdefault("grads", []).append(await status(GRAD, piece(GRAD, m, 2)))
        (mine,) = await stand_in.wait(GROUP_GRAD, 1)
        result["group_meta"] = dict(mine.meta)
        result["group_codecs"] = dict(mine.codecs)
        gradient = mine.tensors["gradient"]
        result["self_member"] = await status(GROUP_GRAD, dataclasses.replace(mine, meta={"member": 1}))
        result["bad_shape"] = await status(GROUP_GRAD, Envelope(
            kind=GROUP_GRAD_KIND, run_id=RUN_ID, step=0, stage=1, meta={"member": 0},
            tensors={"gradient": np.zeros(gradient.size + 1, np.float32)}))
        others = rng.standard_normal(gradient.shape).astype(np.float32)
        result["other"] = await status(GROUP_GRAD, Envelope(kind=GROUP_GRAD_KIND, run_id=RUN_ID, step=0, stage=1,
                                                            meta={"member": 0}, tensors={"gradient": others}))
        back = await stand_in.wait(GRAD, 2)
        result["grad_rows"] = sorted((e.microbatch, e.meta.get("row"), e.tensors[spec.name].shape[0]) for e in back)
        result["grad_codecs"] = {codec for e in back for codec in e.codecs.values()}
        for _ in range(100):  # until the optimizer stepped
            after = StageState.from_envelope((await client.get(worker, WEIGHTS)).envelope())
            if any(not np.array_equal(after.parameters[n], before[n]) for n in before):
                break
            await asyncio.sleep(0.05)
        result.update(before=before, after=after.parameters, own=gradient, others=others,
                      names=[p.name for p in entry.parameters if p.trainable])
        result["before_stop"] = await status(ACT, dataclasses.replace(piece(ACT, 0, 2), step=9))
        await client.post(worker, STOP, b"test over")
        result["after_stop"] = await status(ACT, dataclasses.replace(piece(ACT, 0, 2), step=9))
    finally:
        await end_hand_driven_run(client, worker, stand_in.server)
    return result


def test_a_member_computes_its_rows_and_steps_the_sum_of_the_groups_gradients(plan):
    with LocalCluster(1) as cluster:
        result = asyncio.run(member_one_step(cluster.urls[0], plan))
    assert result["no_row"].startswith("4.00 /act: meta.row None is not the first row of a piece this member takes")
    assert result["not_its_rows"].startswith("4.00 /act: meta.row 0 is not the first row")
    assert result["wrong_size"].startswith("4.00 /act: batch size 3")
    assert result["inputs"] == ["2.04", "2.04"] and result["grads"] == ["2.04", "2.04"]
    # its output rows 2-3 of each micro-batch go to the next stage's one worker, marked with their first row
    assert result["act_rows"] == [(0, 2, 2), (1, 2, 2)]
    assert result["grad_rows"] == [(0, 2, 2), (1, 2, 2)]
    assert result["act_codecs"] == {"int8"} and result["grad_codecs"] == {"fp16"}  # row pieces: the link's codecs
    assert result["group_meta"] == {"member": 1}
    assert result["group_codecs"] == {"gradient": "int8"}  # the run's gradient codec (links have their own)
    assert result["self_member"].startswith("4.00 /groupgrad: meta.member 1 is not another member")
    assert result["bad_shape"].startswith("4.00 /groupgrad expects float32 tensors")
    assert result["other"] == "2.04"
    # plain SGD: the step applied the sum of both members' gradients, in member order; its own part as the
    # other member decodes it (int8), so both step the same weights
    total = result["others"] + result["own"]
    offset = 0
    for name in result["names"]:
        size = result["before"][name].size
        expected = result["before"][name] - LR * total[offset:offset + size].reshape(result["before"][name].shape)
        np.testing.assert_allclose(result["after"][name], expected, rtol=1e-6, atol=1e-7)
        offset += size
    assert offset == total.size
    # a step no run command announced is the sender's error, unless this worker stopped its run
    assert result["before_stop"].startswith("4.00 /act for step 9, which no run command covers")
    assert result["after_stop"] == "5.03 /act for step 9: this worker stopped its run (test over)"
