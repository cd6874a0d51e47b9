"""The coordinator's step ledger: when a step counts as done, and what a recovery undoes."""

import asyncio

from edgert.coordinator.ledger import StepLedger
from edgert.coordinator.runlog import RunLog, read_metrics
from edgert.protocol import StepReport

BATCH = 64


def report(step: int, stage: int) -> StepReport:
    return StepReport(step=step, stage=stage, samples=BATCH if stage == 1 else 0, loss_sum=BATCH * 0.5,
                      started=100.0 + step, finished=100.5 + step)


def ledger_with(tmp_path, steps: int, stages: int = 2) -> StepLedger:
    ledger = StepLedger(RunLog(tmp_path))
    ledger.configure([f"w{k}" for k in range(stages)])
    for step in range(steps):
        ledger.expect(step, epoch=0, samples=BATCH)
    return ledger


def test_a_step_completes_when_every_stage_reported_once(tmp_path):
    ledger = ledger_with(tmp_path, 1)
    ledger.add(report(0, 1), "w1")
    ledger.add(report(0, 1), "w1")  # a retried delivery
    assert ledger.completed == 0 and ledger.missing(0) == [0]
    ledger.add(report(0, 0), "w0")
    assert ledger.completed == 1 and ledger.recent[-1].loss == 0.5
    assert [line["step"] for line in read_metrics(tmp_path) if line["type"] == "step"] == [0]


def test_restart_replays_steps_after_the_snapshot(tmp_path):
    ledger = ledger_with(tmp_path, 6)
    for step in range(5):
        for stage in (0, 1):
            ledger.add(report(step, stage), f"w{stage}")
    assert ledger.completed == 5

    vouched = ledger.restart(["w0"], after=2)
    assert vouched == [] and ledger.completed == 3
    assert ledger.completed_through == 2 and ledger.stages == 1


def test_restart_counts_steps_only_the_snapshot_saw(tmp_path):
    """The last stage copied its state after step 4 and died before its report of steps 3 and 4 left."""
    ledger = ledger_with(tmp_path, 6)
    for step in range(5):
        ledger.add(report(step, 0), "w0")
        if step < 3:
            ledger.add(report(step, 1), "w1")
    assert ledger.completed == 3
    waiting = asyncio.run(_wait_after_restart(ledger, after=4))
    assert waiting is True  # nobody is left waiting on a forgotten step
    assert ledger.completed == 5 and ledger.completed_through == 2
    assert ledger.missing(3) == [0] and ledger.missing(5) == [0]  # forgotten: new reports are needed


async def _wait_after_restart(ledger: StepLedger, after: int) -> bool:
    waiter = asyncio.ensure_future(ledger.wait(5, timeout=5.0))
    await asyncio.sleep(0)
    assert ledger.restart(["w0"], after=after) == [3, 4]
    return await waiter
