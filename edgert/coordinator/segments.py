"""Segments: the runs of steps the coordinator announces to the workers in one ``/run`` each.

:func:`next_segment` cuts the training plan into segments; :class:`SegmentRunner` runs one:
it announces the steps and their schedule, feeds each step's data ``lookahead`` steps
ahead of the slowest stage, waits for the steps to complete, and, when re-planning finds a
better placement, holds the pipeline, truncates it after the last committed step and lets
the cuts move (docs/RUNTIME.md, "Hold and truncate").
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from edgert.coordinator.data import Batch
from edgert.coordinator.evaluation import Evaluation
from edgert.coordinator.failures import FailureDetector
from edgert.coordinator.ledger import StepLedger
from edgert.coordinator.replanning import Replanning
from edgert.coordinator.run_state import RunState
from edgert.coordinator.stage_groups import member_rows
from edgert.models.datasets import Dataset
from edgert.protocol import BATCH, INBOX_CAPACITY, MAX_SEGMENT_STEPS, RUN, Segment, hold_envelope, truncate_envelope
from edgert.schedule import Schedule, microbatches_per_step, split_batch, steps_ahead
from edgert.transport import Envelope, TensorClient

if TYPE_CHECKING:
    from edgert.coordinator.coordinator import TrainConfig
    from edgert.exporter.planner.replanner import Proposal


def next_segment(plan: list[Batch], schedule: str, forced: set[int]) -> tuple[list[Batch], bool]:
    """The plan's first segment and whether it ends an epoch: an epoch (under ``async``, every epoch
    left), cut before every ``forced`` re-plan step and after ``MAX_SEGMENT_STEPS`` steps.

    An ``async`` segment runs on across epoch ends: each is evaluated from the copies the
    stages send after its last step (edgert/coordinator/evaluation.py).
    """
    for k, batch in enumerate(plan):
        following = plan[k + 1] if k + 1 < len(plan) else None
        ends_epoch = following is None or following.epoch != batch.epoch
        if following is None or (ends_epoch and schedule != Schedule.ASYNC) or k + 1 == MAX_SEGMENT_STEPS \
                or following.step in forced:
            return plan[:k + 1], ends_epoch
    return plan, True


class SegmentRunner:
    """Runs one segment at a time on the current placement (``state``); keeps nothing between segments."""

    def __init__(self, config: TrainConfig, state: RunState, client: TensorClient, ledger: StepLedger,
                 dataset: Dataset, failures: FailureDetector, replanning: Replanning, evaluation: Evaluation):
        self._config = config
        self._state = state
        self._client = client
        self._ledger = ledger
        self._dataset = dataset
        self._failures = failures
        self._replanning = replanning
        self._evaluation = evaluation

    async def run(self, plan: list[Batch], final: bool = False) -> int:
        """Run these steps, feeding them ``lookahead`` steps ahead; returns how many ran.

        With re-planning on, every ``replan_every`` completed steps the current placement is
        checked while the pipeline keeps going; a re-plan cuts the segment at the last step
        whose data was sent, drains, moves the cuts, and returns early. While the segment
        drains (unless it is the ``final`` one) the checks go on, and a re-plan waits for it.
        """
        config = self._config
        await self._announce(plan)
        ahead = steps_ahead(config.schedule, len(self._state.manifest.stages), config.micro_batches,
                            config.lookahead, INBOX_CAPACITY)
        in_flight: deque[int] = deque()
        self._replanning.begin_segment()

        async def settle(step: int) -> Proposal | None:
            """Wait for ``step``; then, when due, a better placement or None."""
            await self._failures.wait_step(step)
            return await self._replanning.after_step()

        for batch in plan:
            while len(in_flight) >= ahead:
                proposal = await settle(in_flight.popleft())
                if proposal is not None:
                    return await self._replan_now(proposal, plan, in_flight)
            await self._send_batch(batch)
            in_flight.append(batch.step)
        while in_flight:
            step = in_flight.popleft()
            if final:
                await self._failures.wait_step(step)
                continue
            proposal = await settle(step)
            if proposal is not None:
                return await self._replan_now(proposal, plan, in_flight)
        return len(plan)

    async def _announce(self, plan: list[Batch]) -> None:
        """Tell every worker the segment's steps and schedule (``/run``); expect their reports and the
        copies of the epoch ends inside it."""
        config, state = self._config, self._state
        epoch_ends = {batch.step: batch.epoch for batch, following in zip(plan, plan[1:])
                      if batch.epoch != following.epoch}
        segment = Segment(config.schedule, len(state.manifest.stages), plan[0].step, len(plan), config.batch_size,
                          config.micro_batches, checkpoint_steps=tuple(sorted(epoch_ends)))
        self._evaluation.expect_checkpoints(epoch_ends)
        for batch in plan:
            self._ledger.expect(batch.step, batch.epoch, len(batch.indices))
        envelope = segment.to_envelope(state.run_id)
        state.announced_through = max(state.announced_through, segment.last_step)
        await asyncio.gather(*(self._client.send(url, RUN, envelope) for url in state.placed()))

    async def _replan_now(self, proposal: Proposal, plan: list[Batch], in_flight: deque[int]) -> int:
        """Stop the pipeline after the latest step any stage has committed (run a backward or an
        optimizer step for), re-partition; returns steps run.

        Later steps, even those a fast stage has run forwards for, are dropped and sent again to the
        new placement (docs/RUNTIME.md, "Hold and truncate").
        """
        state = self._state
        replies = await asyncio.gather(*(self._client.send(url, RUN, hold_envelope(state.run_id))
                                         for url in state.placed()))
        committed = max(int(reply.envelope().meta.get("committed", -1)) for reply in replies)
        last = max(committed, self._ledger.completed_through, plan[0].step - 1)
        await asyncio.gather(*(self._client.send(url, RUN, truncate_envelope(state.run_id, last))
                               for url in state.placed()))
        for step in in_flight:
            if step <= last:
                await self._failures.wait_step(step)
        self._ledger.forget([batch.step for batch in plan if batch.step > last])
        await self._evaluation.settle(through_step=last, drop_later=True)
        await self._replanning.repartition(proposal, last + 1)
        return last + 1 - plan[0].step

    async def _send_batch(self, batch: Batch) -> None:
        """The step's inputs to the first stage and labels to the last: one message each (one in all); to a
        group, each member the rows it owns of every micro-batch (edgert/groups.py)."""
        state, config = self._state, self._config
        inputs = state.manifest.model_input[0].name, self._dataset.x_train[batch.indices]
        labels = state.manifest.labels[0].name, self._dataset.y_train[batch.indices]
        sizes = [m.size for m in split_batch(batch.step, config.batch_size,
                                             microbatches_per_step(config.schedule, config.micro_batches))]
        messages: dict[str, dict[str, np.ndarray]] = {}
        last = len(state.order) - 1
        for stage, (name, values) in ((0, inputs), (last, labels)):
            for member, url in enumerate(state.members(stage)):
                rows = member_rows(state.group(stage), member, sizes)
                messages.setdefault(url, {})[name] = np.ascontiguousarray(values[rows])
        await asyncio.gather(*(self._client.send(url, BATCH, Envelope(kind="batch", run_id=state.run_id,
                                                                      step=batch.step, tensors=tensors))
                               for url, tensors in messages.items()))
