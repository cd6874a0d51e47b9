"""Live re-planning: turn measured stage times into device costs, ask the planner, decide.

Each device's cost of each unit starts from its profile (``devices.json``) or, without
one, from the unit's FLOPs; the times the stages report while training correct it with a
per-device factor (FTPipeHD's capacity ratio, updated at every check). A new placement is
proposed only when its predicted step time beats the current one by the threshold and the
gain over the next steps pays for the pause a re-partition costs (measured at the last
re-partition; 1 s before the first).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgert.devices import DevicesFile, load_devices
from edgert.exporter.analyse import ModelAnalysis
from edgert.exporter.export import ExportOptions, prepare_analysis, write_plan
from edgert.exporter.source import load_source_model
from edgert.manifest import Manifest

DEFAULT_PAUSE_S = 1.0
HORIZON_STEPS = 50
SMOOTHING = 0.5  # weight of the newest measurement in a device's speed factor
FALLBACK_BANDWIDTH = 100e6  # bytes/s when no link was measured
BACKWARD_PER_FORWARD = 3.0  # a backward call: recomputed forward + gradients, in forward-FLOP units
FALLBACK_MS_PER_FLOP = 1e-6  # without a profile: 1 GFLOP/s; the measured stage times correct it
FALLBACK_OPTIMIZER_MS_PER_BYTE = 3e-7


@dataclass(frozen=True)
class Proposal:
    """New cuts (block indices) and the worker of each stage, with why."""

    cuts: tuple[int, ...]
    workers: tuple[str, ...]
    gain: float
    current_ms: float
    proposed_ms: float
    reason: str


class Replanner:
    """Keeps device cost estimates and the exporter state needed to build new plans."""

    def __init__(self, plan_dir: Path, manifest: Manifest, cache_dir: Path, devices: Path | None = None,
                 threshold: float = 0.1, batch_size: int = 64, micro_batches: int = 4, schedule: str = "1f1b",
                 memory_mode: str = "recompute"):
        self._source_path = Path(plan_dir) / "source.onnx"
        self.source = load_source_model(self._source_path)
        self._units_manifest: Manifest | None = None
        self.analysis: ModelAnalysis = prepare_analysis(self.source, ExportOptions())
        self.training = manifest.training
        self.memory_mode = memory_mode
        self.cache_dir = cache_dir
        self.threshold = threshold
        self.schedule = schedule
        self.micro_batches = micro_batches if schedule != "async" else 1
        self.micro_batch = batch_size // self.micro_batches
        self.devices: DevicesFile | None = load_devices(devices) if devices else None
        self._units = self._unit_ranges()
        self._factor: dict[str, float] = {}
        self._pause_s = DEFAULT_PAUSE_S

    # -- building plans --------------------------------------------------------------------

    def build(self, cuts: list[int], out_dir: Path) -> Manifest:
        """Export the plan cut before each block index in ``cuts`` (stages re-used from the cache)."""
        return write_plan(self.source, self.analysis, cuts, out_dir, self.training, cache=self.cache_dir)

    def unit_first_block(self, unit: int) -> int:
        """The block index a unit starts at (the planner cuts between units)."""
        return self._units[unit][0]

    def block_cuts(self, manifest: Manifest) -> list[int]:
        index = {block.name: block.index for block in self.analysis.blocks}
        return [index[name] for name in manifest.cuts]

    def _unit_ranges(self) -> list[tuple[int, int]]:
        legal = [c.index for c in self.analysis.cuts if c.legal]
        bounds = [0, *legal, len(self.analysis.blocks)]
        return list(zip(bounds[:-1], bounds[1:]))

    # -- costs ---------------------------------------------------------------------------------

    def _baseline(self, worker: str) -> tuple[list[float], list[float], list[float]]:
        """Forward, backward and optimizer cost of every unit on ``worker`` (ms), before correction.

        From the worker's profile when there is one, else from FLOPs and parameter bytes.
        """
        profile = self._profile(worker)
        if profile is not None and len(profile.blocks) == len(self._units):
            scale = self.micro_batch / self.devices.micro_batch
            return ([t.forward_ms * scale for t in profile.blocks], [t.backward_ms * scale for t in profile.blocks],
                    [t.optimizer_ms for t in profile.blocks])
        flops = [sum(b.flops for b in self.analysis.blocks[a:e]) * self.micro_batch for a, e in self._units]
        params = [sum(b.param_bytes for b in self.analysis.blocks[a:e]) for a, e in self._units]
        return ([f * FALLBACK_MS_PER_FLOP for f in flops],
                [f * FALLBACK_MS_PER_FLOP * BACKWARD_PER_FORWARD for f in flops],
                [p * FALLBACK_OPTIMIZER_MS_PER_BYTE for p in params])

    def _costs(self, worker: str) -> tuple[list[float], list[float]]:
        """Forward and backward ms per micro-batch as the planner sees them: corrected, optimizer included.

        The optimizer steps once per batch (once per micro-batch under async); its time joins
        the backward, which every stage, last or not, runs.
        """
        forward, backward, optimizer = self._baseline(worker)
        factor = self._factor.get(worker, 1.0)
        steps_per_microbatch = 1.0 / self.micro_batches
        return ([f * factor for f in forward],
                [(b + o * steps_per_microbatch) * factor for b, o in zip(backward, optimizer)])

    def _stage_work(self, worker: str, first_block: int, end_block: int, last: bool) -> float:
        """Uncorrected compute per micro-batch of a stage, as the runtime reports it (optimizer included)."""
        forward, backward, optimizer = self._baseline(worker)
        total = 0.0
        for u, (a, e) in enumerate(self._units):
            if first_block <= a and e <= end_block:
                own_forward = 0.0 if last else forward[u]
                total += own_forward + (backward[u] - own_forward if self.stashing and not last else backward[u])
                total += optimizer[u] / self.micro_batches
        return total

    @property
    def stashing(self) -> bool:
        return self.memory_mode == "stash"

    def observe(self, manifest: Manifest, workers: list[str], stage_compute_ms: list[float], step_ms: float) -> None:
        """Correct each worker's speed factor from its stage's measured compute per step."""
        if not stage_compute_ms:
            return
        cuts = [0, *self.block_cuts(manifest), len(self.analysis.blocks)]
        for k, worker in enumerate(workers):
            baseline = self._stage_work(worker, cuts[k], cuts[k + 1], last=k == len(workers) - 1)
            measured = stage_compute_ms[k] / self.micro_batches
            if baseline > 0 and measured > 0:
                ratio = measured / baseline
                old = self._factor.get(worker)
                self._factor[worker] = ratio if old is None else (1 - SMOOTHING) * old + SMOOTHING * ratio

    async def profile(self, client, workers: dict[str, str], scratch: Path, repeats: int = 2) -> None:
        """Measure ``workers`` (URL -> name) on the units, concurrently, and use the profiles from now on.

        Without a ``devices.json``, FLOPs are a poor guide to a device's speed on another block
        range; a quick profile (FTPipeHD re-profiles too) lets the planner place blocks by time.
        """
        import asyncio

        from edgert.devices import DevicesFile
        from edgert.exporter.profiling import export_units, profile_device

        units_dir = scratch / "units"
        if self._units_manifest is None:
            self._units_manifest = export_units(self._source_path, units_dir, self.training)
        manifest = self._units_manifest
        profiles = await asyncio.gather(*(
            profile_device(client, units_dir, manifest, url, name, self.micro_batch, repeats)
            for url, name in workers.items()))
        known = {d.name: d for d in (self.devices.devices if self.devices else ())}
        known.update({p.name: p for p in profiles})
        self.devices = DevicesFile(model_sha256=self.source.sha256, blocks=tuple(
            "+".join(stage.blocks) for stage in manifest.stages), micro_batch=self.micro_batch,
            devices=tuple(known.values()), links=self.devices.links if self.devices else ())
        for name in workers.values():
            self._factor.pop(name, None)  # measured now: no correction learnt against the old baseline

    def record_pause(self, seconds: float) -> None:
        self._pause_s = seconds

    def problem(self, workers: list[str]):
        """The planner's view of the units and of the workers as measured so far."""
        from edgert.exporter.planner import DeviceCosts, PlanProblem

        units = tuple(self._unit(u, a, e) for u, (a, e) in enumerate(self._units))
        devices = []
        for worker in workers:
            forward, backward = self._costs(worker)
            profile = self._profile(worker)
            peaks = tuple(t.peak_bytes for t in profile.blocks) if profile and len(profile.blocks) == len(units) \
                else (0,) * len(units)
            devices.append(DeviceCosts(name=worker, forward_ms=tuple(forward), backward_ms=tuple(backward),
                                       peak_bytes=peaks, memory_bytes=profile.memory_bytes if profile else 0,
                                       cores=profile.cores if profile else 1))
        bandwidth, rtt = self._links(workers)
        slots = 2 if self.training.optimizer == "adamw" else int(bool(self.training.momentum))
        return PlanProblem(units=units, devices=tuple(devices), bandwidth=bandwidth, rtt_ms=rtt,
                           micro_batch=self.micro_batch, micro_batches=self.micro_batches, schedule=self.schedule,
                           optimizer_slots=slots, stash=self.stashing)

    def _unit(self, index: int, first: int, end: int):
        from edgert.exporter.planner import Unit

        blocks = self.analysis.blocks[first:end]
        crossing = self.analysis.inputs if first == 0 else self.analysis.cut_before(first).tensors
        return Unit(name="+".join(b.name for b in blocks), param_bytes=sum(b.param_bytes for b in blocks),
                    input_bytes=sum(t.bytes_per_sample for t in crossing))

    def _profile(self, worker: str):
        if self.devices is None:
            return None
        return next((d for d in self.devices.devices if d.name == worker), None)

    def _links(self, workers: list[str]) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
        bandwidth, rtt = [], []
        for source in workers:
            row_b, row_r = [], []
            for target in workers:
                link = self.devices.link(source, target) if self.devices else None
                row_b.append(link.bandwidth_bytes_per_s if link else FALLBACK_BANDWIDTH)
                row_r.append(link.rtt_ms if link else 0.5)
            bandwidth.append(tuple(row_b))
            rtt.append(tuple(row_r))
        return tuple(bandwidth), tuple(rtt)

    # -- deciding ------------------------------------------------------------------------------

    def propose(self, manifest: Manifest, workers: list[str], force: bool = False,
                cuts: tuple[int, ...] | None = None, candidates: list[str] | None = None) -> Proposal | None:
        """A better placement, or None when the current one (``workers`` by stage) is good enough.

        The planner may order and use any of ``candidates`` (default: the current workers).
        """
        from edgert.exporter.planner import PlanError, evaluate, plan

        pool = list(dict.fromkeys([*workers, *(candidates or [])]))
        problem = self.problem(pool)
        try:
            current = self._step_ms(evaluate(problem, self._stages_of(manifest, workers)))
        except PlanError:
            current = float("inf")  # the current placement no longer fits (a worker left)
        if cuts is not None:
            return Proposal(tuple(cuts), tuple(workers), 1.0, current, current, "forced")
        placement = plan(self.problem(list(candidates or workers)))
        new_cuts = tuple(self._units[u][0] for u in placement.cut_units())
        new_workers = tuple(stage.devices[0] for stage in placement.stages)
        proposed = self._step_ms(placement)
        gain = current / proposed if proposed > 0 else 1.0
        unchanged = list(new_cuts) == self.block_cuts(manifest) and list(new_workers) == list(workers)
        if unchanged and not force:
            return None
        saved_s = (current - proposed) / 1000 * HORIZON_STEPS
        if not force and (gain < 1 + self.threshold or saved_s < self._pause_s):
            return None
        reason = "forced" if force else (f"predicted step {current:.0f} -> {proposed:.0f} ms "
                                         f"(x{gain:.2f}); pays back a {self._pause_s:.1f} s pause")
        return Proposal(new_cuts, new_workers, gain, current, proposed, reason)

    def _step_ms(self, placement) -> float:
        """Time per batch: the bottleneck under async (no flush), the simulated window otherwise."""
        return placement.bottleneck_ms if self.schedule == "async" else placement.predicted_step_ms

    def _stages_of(self, manifest: Manifest, workers: list[str]) -> list[tuple[int, int, tuple[str]]]:
        """The current stages as planner units ranges on their workers."""
        starts = {a: u for u, (a, _) in enumerate(self._units)}
        bounds = [0, *self.block_cuts(manifest), len(self.analysis.blocks)]
        units = [starts.get(b, len(self._units)) for b in bounds]
        return [(units[k], units[k + 1], (worker,)) for k, worker in enumerate(workers)]
