"""The coordinator's evaluations and checkpoints: at each epoch's end, from the stages' states.

Synchronous schedules drain at every step, so an epoch's end is simply the end of a
segment: the coordinator fetches each stage's state and evaluates. An ``async`` pipeline
would have to drain and fill again for that, a whole trip through every stage per epoch;
instead its segment runs on across epoch ends, each stage sends the coordinator a copy of
its state after the epoch's last step (``Segment.checkpoint_steps``), and the coordinator
evaluates from those copies while the pipeline keeps going.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from edgert.checkpoint import CheckpointInfo, save_checkpoint_info
from edgert.errors import EdgertError
from edgert.manifest import MANIFEST_NAME
from edgert.transport import deadline
from edgert.weights import StageState, save_state

SNAPSHOT_WAIT_S = 30.0  # how long the end of a segment waits for the copies of its epoch ends


class EvaluationMixin:
    """Mixin of :class:`edgert.coordinator.coordinator.Coordinator`."""

    def _init_evaluation(self) -> None:
        self._checkpoint_epochs: dict[int, int] = {}  # step -> epoch, awaiting every stage's copy
        self._evaluations: list[asyncio.Task] = []
        self._evaluation_lock = asyncio.Lock()  # one evaluator, one checkpoint folder
        self._checkpoint_arrived = asyncio.Event()  # set whenever an awaited epoch end's copies are all in
        self._shown: dict[int, tuple] = {}  # epoch -> the evaluation printed for it (a replay prints it once)

    def _expect_checkpoints(self, epochs_by_step: dict[int, int]) -> None:
        """Evaluate after these steps (epoch ends inside a segment) once every stage's copy is in."""
        self._checkpoint_epochs.update(epochs_by_step)

    def _snapshot_complete(self, step: int) -> None:
        """Every stage's copy after ``step`` has arrived: evaluate it if that step ends an epoch."""
        epoch = self._checkpoint_epochs.pop(step, None)
        if epoch is None:
            return
        self._checkpoint_arrived.set()
        try:
            states = self.central.snapshot(step, len(self.manifest.stages))
        except (EdgertError, OSError) as error:
            self._skip_evaluation(step, epoch, f"the snapshot is unreadable: {error}")
            return
        self._evaluations.append(asyncio.ensure_future(self._evaluate_states(states, epoch, step, "snapshot")))

    async def _settle_evaluations(self, through_step: int | None = None, drop_later: bool = False) -> None:
        """Wait for the copies of the epoch ends up to ``through_step`` and their evaluations.

        An epoch end whose copies do not all arrive (a worker failed after the step) is not
        evaluated: an ``eval_skipped`` event says so. ``drop_later``: the steps after
        ``through_step`` will run again in a new segment, which expects their copies anew.
        """
        if drop_later and through_step is not None:
            self._checkpoint_epochs = {s: e for s, e in self._checkpoint_epochs.items() if s <= through_step}
        due = [s for s in self._checkpoint_epochs if through_step is None or s <= through_step]
        try:
            async with deadline.timeout(SNAPSHOT_WAIT_S):
                while any(s in self._checkpoint_epochs for s in due):
                    self._checkpoint_arrived.clear()
                    await self._checkpoint_arrived.wait()
        except asyncio.TimeoutError:
            pass  # the copies still missing are skipped below
        for step in [s for s in due if s in self._checkpoint_epochs]:
            self._skip_evaluation(step, self._checkpoint_epochs.pop(step),
                                  "not every stage's copy after that step arrived")
        pending, self._evaluations = self._evaluations, []
        await asyncio.gather(*pending)

    def _forget_checkpoints(self, reason: str, resume: int) -> None:
        """After a recovery that resumes at ``resume``: earlier epoch ends still missing copies are
        skipped; later ones run again, in a segment that expects their copies anew."""
        for step, epoch in sorted(self._checkpoint_epochs.items()):
            if step < resume:
                self._skip_evaluation(step, epoch, reason)
        self._checkpoint_epochs.clear()

    def _skip_evaluation(self, step: int, epoch: int, reason: str) -> None:
        """The epoch ending at ``step`` goes unevaluated: say why (an ``eval_skipped`` event)."""
        self.log.event("eval_skipped", step=step, epoch=epoch, reason=reason)

    async def _evaluate(self, epoch: int, step: int) -> tuple[float | None, float | None]:
        """Evaluate the stages' current states (the pipeline has drained after ``step``)."""
        await self._settle_evaluations()
        return await self._evaluate_states(await self._fetch_states(), epoch, step, "drained")

    async def _evaluate_states(self, states: list[StageState], epoch: int, step: int,
                               source: str) -> tuple[float | None, float | None]:
        """Save ``states`` as the latest checkpoint, evaluate them on the test set, log the result."""
        async with self._evaluation_lock:
            folder = self.config.out_dir / "checkpoints" / "latest"
            for stale in folder.glob("stage*.cbor"):
                stale.unlink()
            written = sum(save_state(state, folder / f"stage{k}.cbor", self.run_id) for k, state in enumerate(states))
            self._copy_plan(self.config.out_dir / "plan")
            save_checkpoint_info(CheckpointInfo(step=step, epoch=epoch, stages=len(states)), folder)
            loss, accuracy = await asyncio.get_running_loop().run_in_executor(
                None, self._evaluator.evaluate, states, self.dataset.x_test, self.dataset.y_test)
        self.log.record("eval", epoch=epoch, step=step, test_loss=loss, test_accuracy=accuracy,
                        checkpoint_bytes=written, source=source)
        if self._progress is not None and self._shown.get(epoch) != (loss, accuracy):
            again = " (replayed)" if epoch in self._shown else ""
            self._shown[epoch] = (loss, accuracy)
            accuracy_text = f", test accuracy {accuracy:.4f}" if accuracy is not None else ""
            self._progress.message(f"epoch {epoch + 1}: test loss {loss:.4f}{accuracy_text}{again}")
        return loss, accuracy

    def _copy_plan(self, target: Path) -> None:
        """The run's plan folder follows re-partitions, so a checkpoint always matches it."""
        if self.plan_dir.resolve() != target.resolve():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.plan_dir / MANIFEST_NAME, target / MANIFEST_NAME)
