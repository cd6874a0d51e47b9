"""Measuring a stage on this device: forward and backward times and peak memory.

Runs the stage's own sessions (the code path training uses) on seeded random inputs of
one micro-batch, a few times, and keeps the median. Peak memory is the rise of the
process's high-water mark (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``)
over its resident size before the runs.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Hashable
from pathlib import Path

import numpy as np

from edgert.devices import BlockTiming
from edgert.manifest import BoundaryTensor
from edgert.optimizer import make_optimizer
from edgert.schedule import Computation
from edgert.stage import StageSession
from edgert.worker.slowdown import WEIGHT_CALL, SlowdownEmulator, SlowdownSchedule


def random_tensor(tensor: BoundaryTensor, batch: int, rng: np.random.Generator) -> np.ndarray:
    """A tensor of the spec's shape: normal floats, or zeros for integers (valid indices)."""
    shape = tensor.shape_for(batch)
    if np.issubdtype(np.dtype(tensor.dtype), np.floating):
        return rng.standard_normal(shape).astype(tensor.dtype)
    return np.zeros(shape, dtype=tensor.dtype)


def measure_stage(session: StageSession, micro_batch: int, repeats: int, warmup: int = 2,
                  slowdown: SlowdownSchedule | None = None, name: str | None = None) -> BlockTiming:
    """Median forward and backward milliseconds of one micro-batch, and peak bytes.

    The backward is timed as training without stashing runs it: the forward it recomputes
    included (a stashing session's forward time is added to it); a session that splits its
    backward, its two halves' calls together, the weight half's also on its own (``weight_ms``).
    """
    feeds = _random_feeds(session, micro_batch)
    emulator = SlowdownEmulator(slowdown)
    forward, backward, optimizer, weight = [], [], [], []
    saved = session.parameters()
    resident = _resident_bytes()
    _reset_peak()
    for attempt in range(warmup + repeats):
        emulate = attempt >= warmup  # warm-ups run back to back: they give the emulator warm times
        forward_ms, backward_ms, weight_ms, optimizer_ms = _one_pass(session, feeds, micro_batch, emulator, emulate)
        if emulate:
            forward.append(forward_ms)
            backward.append(backward_ms + weight_ms + (forward_ms if session.stashing else 0.0))
            weight.append(weight_ms)
            optimizer.append(optimizer_ms)
    peak = max(_peak_bytes() - resident, 0)
    session.load_parameters(saved)  # measuring must not train
    session.optimizer = make_optimizer(session.training)
    return BlockTiming(block=name or "+".join(session.entry.blocks), forward_ms=round(statistics.median(forward), 4),
                       backward_ms=round(statistics.median(backward), 4), peak_bytes=int(peak),
                       optimizer_ms=round(statistics.median(optimizer), 4),
                       weight_ms=round(statistics.median(weight), 4))


def warm_up(session: StageSession, micro_batch: int, emulator: SlowdownEmulator, passes: int = 2) -> None:
    """Run the stage back to back on random data so ``emulator`` knows its warm compute times.

    Parameters, running statistics and optimizer state are restored: nothing is learnt.
    """
    feeds = _random_feeds(session, micro_batch)
    saved, optimizer = session.parameters(), copy.deepcopy(session.optimizer)
    try:
        for _ in range(passes):
            _one_pass(session, feeds, micro_batch, emulator, emulate=False)
    finally:
        session.load_parameters(saved)
        session.optimizer = optimizer
        session.zero_grad()


Feeds = tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]


def _random_feeds(session: StageSession, micro_batch: int) -> Feeds:
    """Inputs, labels and output gradients of one seeded random micro-batch."""
    entry = session.entry
    rng = np.random.default_rng(0)
    return ({t.name: random_tensor(t, micro_batch, rng) for t in entry.inputs},
            {t.name: random_tensor(t, micro_batch, rng) for t in entry.labels},
            {t.name: random_tensor(t, micro_batch, rng) for t in entry.outputs if t.name in entry.output_gradients})


def _one_pass(session: StageSession, feeds: Feeds, rows: int, emulator: SlowdownEmulator,
              emulate: bool) -> tuple[float, float, float, float]:
    """Forward, backward, a split backward's weight call and optimizer step, as the executor runs them; ms each
    (emulated or warm)."""
    inputs, labels, gradients = feeds
    keep: dict | None = {} if session.stashing else None
    start = _clock()
    session.forward(inputs, keep)
    forward_ms = _elapsed_ms(start, emulator, (Computation.FORWARD, rows), session.single_threaded, emulate)
    start = _clock()
    session.backward(inputs, output_gradients=gradients or None, labels=labels or None, saved=keep)
    backward_ms = _elapsed_ms(start, emulator, (Computation.BACKWARD, rows), session.single_threaded, emulate)
    weight_ms = 0.0
    if session.splits:
        start = _clock()
        session.finish_weights()
        weight_ms = _elapsed_ms(start, emulator, (WEIGHT_CALL, rows), session.single_threaded, emulate)
    start = _clock()
    session.step()
    optimizer_ms = _elapsed_ms(start, emulator, Computation.STEP, True, emulate)
    return forward_ms, backward_ms, weight_ms, optimizer_ms


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _elapsed_ms(start: tuple[float, float], emulator: SlowdownEmulator, call: Hashable, single_threaded: bool,
                emulate: bool) -> float:
    wall = time.perf_counter() - start[0]
    cpu = time.thread_time() - start[1] if single_threaded else None
    if not emulate:
        emulator.record(call, wall, cpu)
        return wall * 1000
    slept = emulator.emulate(0, call, wall, cpu)
    return (wall + slept) * 1000


def _status_field(field_name: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _resident_bytes() -> int:
    return _status_field("VmRSS")


def _peak_bytes() -> int:
    return _status_field("VmHWM")


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


async def probe_link(client, target: str, sizes: tuple[int, ...] = (64, 1 << 20), repeats: int = 5) -> dict:
    """RTT (smallest payload) and bandwidth (largest) from this device to ``target``'s ``/echo``."""
    results = {}
    for size in sizes:
        payload = bytes(size)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            await client.post(target, "echo", payload, timeout=30.0, retries=0)
            times.append(time.perf_counter() - started)
        results[size] = statistics.median(times[1:])
    small, large = min(sizes), max(sizes)
    rtt = results[small]
    bandwidth = (large - small) / max(results[large] - rtt, 1e-6)
    return {"rtt_ms": round(rtt * 1000, 4), "bandwidth_bytes_per_s": round(bandwidth, 1)}
