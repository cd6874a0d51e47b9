"""The coordinator's evaluations and checkpoints: at each epoch's end, from the stages' states.

Synchronous schedules drain at every step, so an epoch's end is simply the end of a
segment: the coordinator fetches each stage's state and evaluates. An ``async`` pipeline
would have to drain and fill again for that, a whole trip through every stage per epoch;
instead its segment runs on across epoch ends, each stage sends the coordinator a copy of
its state after the epoch's last step (``Segment.checkpoint_steps``), and the coordinator
evaluates from those copies while the pipeline keeps going.

The states are evaluated here, on the central node: :class:`StateScorer` runs the plan's
inference graphs chained, so evaluation never stalls the workers' pipeline beyond the
drain it needs anyway.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np

from edgert.chain import StageChain
from edgert.checkpoint import CheckpointInfo, save_checkpoint_info
from edgert.coordinator.inputs import stage_state_bound
from edgert.coordinator.run_state import RunState
from edgert.coordinator.runlog import RunLog
from edgert.coordinator.snapshots import CentralCopies
from edgert.errors import EdgertError
from edgert.manifest import MANIFEST_NAME, Manifest
from edgert.models.datasets import Dataset
from edgert.progress import Progress
from edgert.protocol import WEIGHTS
from edgert.scoring import Score
from edgert.transport import TensorClient, deadline
from edgert.weights import StageState, load_state, save_state, state_pieces

SNAPSHOT_WAIT_S = 30.0  # how long the end of a segment waits for the copies of its epoch ends


class StateScorer:
    """Scores stage states: a local copy of the plan's stages, loaded with the states, run on the test set."""

    def __init__(self, plan_dir: Path, manifest: Manifest):
        self.plan_dir = plan_dir  # the plan the states it evaluates belong to
        self._chain = StageChain(plan_dir, manifest)
        self._manifest = manifest

    def evaluate(self, states: list[StageState], x: np.ndarray, y: np.ndarray,
                 batch_size: int = 256) -> tuple[float, float | None]:
        for stage, state in zip(self._chain.stages, states):
            stage.load_parameters(state.parameters)
        input_name = self._manifest.model_input[0].name
        score = Score(self._manifest.training.loss)
        for i in range(0, len(x), batch_size):
            score.add(self._chain.infer({input_name: x[i:i + batch_size]}), y[i:i + batch_size])
        return score.mean_loss, score.accuracy


class Evaluation:
    """Evaluates the run's epoch ends and keeps the latest as its checkpoint (``checkpoints/latest``).

    Owns the epoch ends awaiting copies, the evaluations under way and the local scorer;
    reads the placement from ``state`` and the async schedule's copies from ``central``.
    """

    def __init__(self, out_dir: Path, state: RunState, client: TensorClient, log: RunLog, dataset: Dataset,
                 central: CentralCopies, progress: Progress):
        self._out_dir = out_dir
        self._state = state
        self._client = client
        self._log = log
        self._dataset = dataset
        self._central = central
        self._progress = progress
        self._scorer: StateScorer | None = None
        self._checkpoint_epochs: dict[int, int] = {}  # step -> epoch, awaiting every stage's copy
        self._evaluations: list[asyncio.Task] = []
        self._lock = asyncio.Lock()  # one scorer, one checkpoint folder
        self._checkpoint_arrived = asyncio.Event()  # set whenever an awaited epoch end's copies are all in
        self._shown: dict[int, tuple] = {}  # epoch -> the evaluation printed for it (a replay prints it once)

    def use_plan(self, plan_dir: Path, manifest: Manifest) -> None:
        """Evaluate with this plan's stages from now on (the cuts moved)."""
        self._scorer = StateScorer(plan_dir, manifest)

    def expect_checkpoints(self, epochs_by_step: dict[int, int]) -> None:
        """Evaluate after these steps (epoch ends inside a segment) once every stage's copy is in."""
        self._checkpoint_epochs.update(epochs_by_step)

    def snapshot_complete(self, step: int) -> None:
        """Every stage's copy after ``step`` has arrived: evaluate it if that step ends an epoch."""
        epoch = self._checkpoint_epochs.pop(step, None)
        if epoch is None:
            return
        self._checkpoint_arrived.set()
        try:
            states = self._central.snapshot(step, len(self._state.manifest.stages))
        except (EdgertError, OSError) as error:
            self._skip(step, epoch, f"the snapshot is unreadable: {error}")
            return
        # evaluated on the plan the copies are of, even if a recovery moves the cuts before it runs
        evaluation = self._evaluate_states(states, self._scorer, epoch, step, "snapshot")
        self._evaluations.append(asyncio.ensure_future(evaluation))

    async def settle(self, through_step: int | None = None, drop_later: bool = False) -> None:
        """Wait for the copies of the epoch ends up to ``through_step`` and their evaluations.

        An epoch end whose copies do not all arrive (a worker failed after the step) is not
        evaluated: an ``eval_skipped`` event says so. ``drop_later``: the steps after
        ``through_step`` will run again in a new segment, which expects their copies anew.
        """
        if drop_later and through_step is not None:
            self._checkpoint_epochs = {s: e for s, e in self._checkpoint_epochs.items() if s <= through_step}
        due = [s for s in self._checkpoint_epochs if through_step is None or s <= through_step]
        await self._wait_copies(due)
        for step in [s for s in due if s in self._checkpoint_epochs]:
            self._skip(step, self._checkpoint_epochs.pop(step), "not every stage's copy after that step arrived")
        pending, self._evaluations = self._evaluations, []
        await asyncio.gather(*pending)

    def forget_checkpoints(self, reason: str, resume: int) -> None:
        """After a recovery that resumes at ``resume``: earlier epoch ends still missing copies are
        skipped; later ones run again, in a segment that expects their copies anew."""
        for step, epoch in sorted(self._checkpoint_epochs.items()):
            if step < resume:
                self._skip(step, epoch, reason)
        self._checkpoint_epochs.clear()

    async def evaluate(self, epoch: int, step: int) -> tuple[float | None, float | None]:
        """Evaluate the stages' current states (the pipeline has drained after ``step``), fetched in pieces
        straight into the checkpoint's files."""
        await self.settle()
        async with self._lock:
            written = await self._fetch_states(self._checkpoint_folder())
        states = [load_state(path) for path in written]
        return await self._evaluate_states(states, self._scorer, epoch, step, "drained", written)

    # -- the steps -------------------------------------------------------------------------------

    async def _wait_copies(self, due: list[int]) -> None:
        """Until every stage's copy after each of ``due`` is in, or :data:`SNAPSHOT_WAIT_S` passed."""
        try:
            async with deadline.timeout(SNAPSHOT_WAIT_S):
                while any(s in self._checkpoint_epochs for s in due):
                    self._checkpoint_arrived.clear()
                    await self._checkpoint_arrived.wait()
        except asyncio.TimeoutError:
            pass  # the copies still missing are skipped

    def _skip(self, step: int, epoch: int, reason: str) -> None:
        """The epoch ending at ``step`` goes unevaluated: say why (an ``eval_skipped`` event)."""
        self._log.event("eval_skipped", step=step, epoch=epoch, reason=reason)

    async def _fetch_states(self, folder: Path) -> list[Path]:
        """Every stage's state (``GET /weights``), each written to ``folder``/stage<k>.cbor as its pieces arrive,
        never more of it than the plan's stage holds."""
        manifest = self._state.manifest

        async def fetch(k: int, url: str) -> Path:
            path = folder / f"stage{k}.cbor"
            await self._client.request("GET", url, WEIGHTS, timeout=120.0,
                                       pieces=state_pieces(stage_state_bound(manifest, k), into=path))
            return path

        return list(await asyncio.gather(*(fetch(k, url) for k, url in enumerate(self._state.order))))

    async def _evaluate_states(self, states: list[StageState], scorer: StateScorer, epoch: int, step: int,
                               source: str, written: list[Path] | None = None) -> tuple[float | None, float | None]:
        """Save ``states`` (of ``scorer``'s plan) as the latest checkpoint (``written``: they are in its files
        already), evaluate them on the test set, log the result."""
        async with self._lock:
            size = self._save_checkpoint(states, scorer.plan_dir, epoch, step, written)
            loss, accuracy = await asyncio.get_running_loop().run_in_executor(
                None, scorer.evaluate, states, self._dataset.x_test, self._dataset.y_test)
        self._log.record("eval", epoch=epoch, step=step, test_loss=loss, test_accuracy=accuracy,
                         checkpoint_bytes=size, source=source)
        self._show(epoch, loss, accuracy)
        return loss, accuracy

    def _checkpoint_folder(self) -> Path:
        return self._out_dir / "checkpoints" / "latest"

    def _save_checkpoint(self, states: list[StageState], plan_dir: Path, epoch: int, step: int,
                         written: list[Path] | None = None) -> int:
        """``states`` as ``checkpoints/latest`` (unless ``written`` there already), with the plan they belong to
        (``plan_dir``'s) and its index; returns the checkpoint's bytes."""
        folder = self._checkpoint_folder()
        if written is None:
            written = [folder / f"stage{k}.cbor" for k in range(len(states))]
            for k, state in enumerate(states):
                save_state(state, written[k], self._state.run_id)
        for stale in folder.glob("stage*.cbor"):
            if stale not in written:
                stale.unlink()
        self._copy_plan(plan_dir, self._out_dir / "plan")
        save_checkpoint_info(CheckpointInfo(step=step, epoch=epoch, stages=len(states)), folder)
        return sum(path.stat().st_size for path in written)

    def _copy_plan(self, plan_dir: Path, target: Path) -> None:
        """The run's plan folder follows re-partitions, so a checkpoint always matches it."""
        if plan_dir.resolve() != target.resolve():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(plan_dir / MANIFEST_NAME, target / MANIFEST_NAME)

    def _show(self, epoch: int, loss: float | None, accuracy: float | None) -> None:
        """The epoch's result on the progress display: once, and again only if a replay changed it."""
        if self._shown.get(epoch) == (loss, accuracy):
            return
        again = " (replayed)" if epoch in self._shown else ""
        self._shown[epoch] = (loss, accuracy)
        accuracy_text = f", test accuracy {accuracy:.4f}" if accuracy is not None else ""
        self._progress.message(f"epoch {epoch + 1}: test loss {loss:.4f}{accuracy_text}{again}")
