"""The coordinator's ``PUT /replica`` and ``POST /report`` take only what its plan's workers send, within a budget.

During a real run, a flood of 8 MiB copies of stages the plan does not have, under made-up
``meta.origin`` names, is refused (4.00) and the coordinator keeps none of it, in memory
or on disk; over TLS a copy or a report of a stage comes only from the credential of the
worker that stage is assigned to (4.03), the origin recorded is that credential's name, and
the run ends normally.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from edgert.coordinator.coordinator import TrainConfig
from edgert.coordinator.localcluster import LocalCluster
from edgert.protocol import JOIN, REPLICA, REPORT, JoinRequest
from edgert.transport import ClientConfig, Envelope, SyncClient, TensorClient
from edgert.transport.limits import MiB
from edgert.weights import StageState
from tests.resident_memory import resident_bytes
from tests.running_coordinator import RunningCoordinator

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH, MICRO = 60, 32, 2

#: The flood's run: long enough to outlast 40 copies of 8 MiB by far (60 steps took about as long, and a
#: run that ended under the flood refused its connections).
FLOOD_STEPS = 600


def config(plan: Path, workers: LocalCluster, out: Path, steps: int = STEPS, **more) -> TrainConfig:
    return TrainConfig(plan_dir=plan, workers=tuple(workers.urls), out_dir=out, steps=steps, epochs=100,
                       batch_size=BATCH, micro_batches=MICRO, schedule="1f1b", progress=False, central_every=10,
                       **{"listen": "coap+tcp://127.0.0.1:0", **more})


def copy(run_id: str, stage: int, step: int, size: int, origin: str) -> Envelope:
    state = StageState(parameters={"w": np.ones(size // 4, np.float32)}, step=step, stage=stage)
    return Envelope("weights", run_id=run_id, step=step, stage=stage, tensors=state.to_envelope(run_id).tensors,
                    meta={"origin": origin})


def kept_bytes(running: RunningCoordinator) -> int:
    return sum(h.bytes for h in running.coordinator.recovery.central.holdings())


def test_a_flood_of_copies_of_stages_the_plan_lacks_is_refused_and_kept_nowhere(mlp_plan3, tmp_path):
    with LocalCluster(3) as workers:
        running = RunningCoordinator(config(mlp_plan3, workers, tmp_path / "run", FLOOD_STEPS)).start()
        url = running.wait_training(announced=3)
        with SyncClient.start(ClientConfig(timeout=60.0, retries=0)) as client:
            client.request("PUT", url, REPLICA, copy(running.run_id, 99, 3, 8 * MiB, "warm-up"),
                           raise_for_status=False)
            before = resident_bytes()
            answers = [client.request("PUT", url, REPLICA, copy(running.run_id, 100 + i, 3, 8 * MiB, f"evil-{i}"),
                                      raise_for_status=False) for i in range(40)]
            grown, strays = resident_bytes() - before, [h for h in running.coordinator.recovery.central.holdings()
                                             if h.stage > 2 or h.origin.startswith("evil")]
            late = client.request("PUT", url, REPLICA, copy(running.run_id, 0, 10**6, 1024, "x"),
                                  raise_for_status=False)
            over = client.request("PUT", url, REPLICA, copy(running.run_id, 0, 3, 2 * MiB, "x"),  # > stage 0's state
                                  raise_for_status=False)
            other = client.request("PUT", url, REPLICA, copy("another-run", 0, 3, 1024, "x"), raise_for_status=False)
        summary = running.finish()
    assert {a.code.dotted for a in answers} == {"4.00"}, {a.code.dotted for a in answers}
    assert answers[0].text == "a copy of stage 100; the plan has stages 0 to 2"
    assert not strays and grown < 64 * MiB, f"kept {strays}; RSS grew by {grown / MiB:.0f} MiB"
    assert late.code.dotted == "4.00" and late.text.startswith(f"a copy after step {10**6}; this run has sent steps")
    assert over.code.dotted == "4.13" and "of stage 0, whose whole state takes at most" in over.text, over.text
    assert other.code.dotted == "4.00" and "a copy of run 'another-run'" in other.text
    assert summary.steps == FLOOD_STEPS
    assert not list((tmp_path / "run" / "snapshots").glob("step_*/stage[!012]*.cbor"))
    holdings = running.coordinator.recovery.central.holdings()
    assert {h.stage for h in holdings} == {0, 1, 2}
    assert all(h.origin.startswith("127.0.0.1:") for h in holdings), {h.origin for h in holdings}


def test_over_tls_copies_and_reports_come_only_from_the_stages_worker(cluster, mlp_plan3, tmp_path):
    with LocalCluster(3, names=["w0", "w1", "w2"], credentials=cluster.workers[:3]) as workers:
        running = RunningCoordinator(config(mlp_plan3, workers, tmp_path / "run", keys=cluster.keys,
                                            listen="coaps+tcp://127.0.0.1:0")).start()
        url = running.wait_training(announced=3)
        run_id = running.run_id
        report = Envelope("report", run_id=run_id, stage=0, meta={"worker": "w0", "failed": "made up"})
        attempts = {  # name: (credential, path, envelope)
            "copy of stage 0 from w1": (cluster.workers[1], REPLICA, copy(run_id, 0, 3, 1024, "w0")),
            "copy of stage 0 from w3": (cluster.workers[3], REPLICA, copy(run_id, 0, 3, 1024, "w0")),
            "failure of stage 0 from w3": (cluster.workers[3], REPORT, report),
            "join of w1 by w3": (cluster.workers[3], JOIN, JoinRequest(workers.urls[1], "w1").to_envelope()),
        }

        async def send(credential, path, envelope):
            async with TensorClient(tls=cluster.tls(credential)) as client:
                method = "PUT" if path == REPLICA else "POST"
                return await client.request(method, url, path, envelope, retries=0, timeout=30,
                                            raise_for_status=False)

        answers = {name: asyncio.run(send(*attempt)) for name, attempt in attempts.items()}
        summary = running.finish()
    for name, answer in answers.items():
        assert answer.code.dotted == "4.03", (name, answer.code.dotted, answer.text)
    assert "a copy of stage 0 comes only from its worker 'w0', not" in answers["copy of stage 0 from w1"].text
    assert "a report of stage 0 comes only from its worker 'w0', not" in answers["failure of stage 0 from w3"].text
    assert "worker 'w3' may join only as itself, not as worker 'w1'" in answers["join of w1 by w3"].text
    assert summary.steps == STEPS
    assert {h.origin for h in running.coordinator.recovery.central.holdings()} == {"w0", "w1", "w2"}
