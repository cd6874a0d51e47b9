"""Live re-planning: turn measured stage times into device costs, ask the planner, decide.

Each device's cost of each unit comes from its profile (``devices.json``, or a quick profile
the coordinator takes); the times the stages report while training correct it with a
per-device factor (FTPipeHD's capacity ratio, updated at every check). A device without a
profile is costed by the latency predictor fitted on the profiled ones, which learns that
device's rates online from its reported stage times (AccEPT); with no profile at all, FLOPs
stand in until the first measurements; a group member is learnt from its own times and
share. Where groups are allowed, the current cuts with an idle worker added to one stage
(no re-cut) are weighed beside the planner's best. A new placement is proposed only when,
over the steps the run has left, its predicted time plus the pause it costs (a re-cut's or a
regroup's, as measured at the last one of its kind) beats the current placement's by at
least the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgert.devices import DeviceProfile, DevicesFile, load_devices
from edgert.exporter.analyse import ModelAnalysis
from edgert.exporter.errors import PlanError, PredictorError
from edgert.exporter.export import ExportOptions, prepare_analysis, write_plan
from edgert.exporter.normalise import frozen_in
from edgert.exporter.planner.profile_costs import UnitCosts, parallel_fractions, profiled_weights, split_stage_cost
from edgert.exporter.predictor.features import block_features, join_features
from edgert.exporter.predictor.latency import LatencyPredictor
from edgert.exporter.predictor.observations import observations_from_devices
from edgert.exporter.source import SOURCE_FILE, load_plan_source
from edgert.manifest import Manifest
from edgert.schedule import Schedule, microbatches_per_step

DEFAULT_PAUSE_S = 1.0
DEFAULT_REGROUP_PAUSE_S = 0.5  # the cuts stay: no plan to build, only the workers new to a stage fetch state
GAIN_TOLERANCE = 1e-9  # a gain equal to the threshold, up to rounding, meets it
SMOOTHING = 0.5  # weight of the newest measurement in a device's speed factor
SPEED_CHANGE = 1.5  # a measurement this far from the factor is a new speed (throttling), not noise
FALLBACK_BANDWIDTH = 100e6  # bytes/s when no link was measured
BACKWARD_PER_FORWARD = 3.0  # a backward call: recomputed forward + gradients, in forward-FLOP units
FALLBACK_MS_PER_FLOP = 1e-6  # without a profile: 1 GFLOP/s; the measured stage times correct it
FALLBACK_OPTIMIZER_MS_PER_BYTE = 3e-7


@dataclass(frozen=True)
class MemberTimes:
    """A worker's median forward, backward and optimizer ms per step on its stage, and its share of each
    micro-batch (1 alone; a group member's part of the rows)."""

    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    share: float


@dataclass(frozen=True)
class _Option:
    """A placement the re-planner weighs: its cuts, each stage's workers, its step time and the pause to move."""

    placement: object  # exporter.planner.placement.Placement
    cuts: tuple[int, ...]
    members: tuple[tuple[str, ...], ...]
    step_ms: float
    pause_s: float


@dataclass(frozen=True)
class Proposal:
    """New cuts (block indices) and the worker of each stage, with why."""

    cuts: tuple[int, ...]
    workers: tuple[str, ...]  # each stage's worker (a group's first member: its holder of record)
    gain: float
    current_ms: float
    proposed_ms: float
    reason: str
    members: tuple[tuple[str, ...], ...] = ()  # each stage's workers, a group's every member (empty: ``workers``)
    shares: tuple[tuple[float, ...], ...] = ()  # each member's part of every micro-batch, as ``members``
    link_codecs: tuple[str, ...] = ()  # the planner's codec per measured link, else none (empty: forced cuts)

    def stage_members(self) -> tuple[tuple[str, ...], ...]:
        """Each stage's workers: one, or a group's members."""
        return self.members or tuple((worker,) for worker in self.workers)


class Replanner:
    """Keeps device cost estimates and the exporter state needed to build new plans."""

    def __init__(self, plan_dir: Path, manifest: Manifest, cache_dir: Path, devices: Path | None = None,
                 threshold: float = 0.1, batch_size: int = 64, micro_batches: int = 4, schedule: str = "1f1b",
                 memory_mode: str = "recompute", side_by_side: bool = False, split_backward: bool = False):
        self.source_path = Path(plan_dir) / SOURCE_FILE  # the model the units of a live profile are cut from
        self.source = load_plan_source(plan_dir, manifest.source_sha256)
        self.analysis: ModelAnalysis = prepare_analysis(self.source, ExportOptions(frozen=frozen_in(manifest.metadata)))
        self.training = manifest.training
        self.memory_mode = memory_mode
        self.side_by_side = side_by_side  # stages run their forwards beside their backwards (costed so)
        self.split_backward = split_backward  # stages after the first compute their weight gradients once a step
        self.cache_dir = cache_dir
        self.threshold = threshold
        self.schedule = schedule
        self.micro_batches = microbatches_per_step(schedule, micro_batches)
        self.micro_batch = batch_size // self.micro_batches
        self.devices: DevicesFile | None = load_devices(devices) if devices else None
        self._units = self._unit_ranges()
        features = block_features(self.analysis)
        self._unit_features = [join_features(features[a:e]) for a, e in self._units]
        self._param_bytes = [sum(b.param_bytes for b in self.analysis.blocks[a:e]) for a, e in self._units]
        self._factor: dict[str, float] = {}
        self._pause_s = DEFAULT_PAUSE_S
        self._regroup_pause_s = DEFAULT_REGROUP_PAUSE_S
        self.last_check: dict = {}  # what the latest propose() saw and decided, for the run log
        self.predictor: LatencyPredictor | None = None
        self._fit_predictor()

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

    def _baseline(self, worker: str) -> UnitCosts:
        """``worker``'s cost of every unit (ms per micro-batch) and of being a stage, before correction.

        From the worker's profile when there is one, else from the latency predictor, else from
        FLOPs and parameter bytes.
        """
        profile = self._profile(worker)
        if profile is not None:
            scale = self.micro_batch / self.devices.micro_batch
            units = ([t.forward_ms * scale for t in profile.blocks], [t.backward_ms * scale for t in profile.blocks],
                     [t.optimizer_ms for t in profile.blocks])
            whole = profile.whole
            return split_stage_cost(*units, (whole.forward_ms * scale, whole.backward_ms * scale,
                                             whole.optimizer_ms) if whole else None, self._param_bytes)
        params = self._param_bytes
        optimizer = [p * FALLBACK_OPTIMIZER_MS_PER_BYTE for p in params]
        if self._predicts(worker):
            if worker not in self.predictor.devices:
                self.predictor.add_device(worker)
            times = self.predictor.predict_many(worker, self._unit_features, [self.micro_batch] * len(self._units))
            forward, backward = self.predictor.predict(worker, join_features(self._unit_features), self.micro_batch)
            return split_stage_cost(list(times[:, 0]), list(times[:, 1]), optimizer,
                                    (forward, backward, sum(optimizer)))
        flops = [sum(b.flops for b in self.analysis.blocks[a:e]) * self.micro_batch for a, e in self._units]
        return UnitCosts([f * FALLBACK_MS_PER_FLOP for f in flops],
                         [f * FALLBACK_MS_PER_FLOP * BACKWARD_PER_FORWARD for f in flops], optimizer)

    def _predicts(self, worker: str) -> bool:
        """Whether ``worker``'s costs come from the latency predictor (it has no usable profile)."""
        return self.predictor is not None and self._profile(worker) is None

    def _fit_predictor(self) -> None:
        """Fit the latency predictor on the profiles known so far (none: no predictor)."""
        try:
            observations = observations_from_devices(self.devices, self.analysis) if self.devices else []
            self.predictor = LatencyPredictor().fit(observations) if observations else None
        except PredictorError:
            self.predictor = None  # profiles of another model version: FLOPs and measurements instead

    def _costs(self, worker: str) -> tuple[list[float], list[float], float, float]:
        """Forward and backward ms per unit and micro-batch as the planner sees them, and the stage's fixed
        cost (as any stage, and as the last, which makes no forward call): corrected, optimizer included.

        The optimizer steps once per batch (once per micro-batch under async); its time joins
        the backward, which every stage, last or not, runs.
        """
        costs = self._baseline(worker)
        factor = self._factor.get(worker, 1.0)
        per_microbatch = 1.0 / self.micro_batches
        call_forward, call_backward, call_optimizer = costs.call
        last_call = (call_backward + call_optimizer * per_microbatch) * factor
        return ([f * factor for f in costs.forward],
                [(b + o * per_microbatch) * factor for b, o in zip(costs.backward, costs.optimizer)],
                call_forward * factor + last_call, last_call)

    def _stage_work(self, worker: str, first_block: int, end_block: int, last: bool, share: float = 1.0) -> float:
        """Uncorrected compute per micro-batch of a stage, as the runtime reports it (optimizer included); a group
        member computing ``share`` of each micro-batch pays the calls' fixed cost whole and the rest in part."""
        costs = self._baseline(worker)
        call_forward, call_backward, call_optimizer = costs.call
        total = call_backward + call_optimizer / self.micro_batches + (0.0 if last else call_forward)
        for u, (a, e) in enumerate(self._units):
            if first_block <= a and e <= end_block:
                own_forward = 0.0 if last else costs.forward[u]
                total += share * (own_forward + (costs.backward[u] - own_forward if self.stashing and not last
                                                 else costs.backward[u]))
                total += costs.optimizer[u] / self.micro_batches
        return total

    @property
    def stashing(self) -> bool:
        return self.memory_mode == "stash"

    def observe(self, manifest: Manifest, workers: list[str], stage_times_ms: list[tuple[float, float, float]],
                step_ms: float, members: list[dict[str, MemberTimes]] | None = None) -> None:
        """Learn each worker's speed from its stage's measured (forward, backward, optimizer) ms per step; a stage
        held by a group (``members[k]`` not empty) from each member's own times and share instead.

        A worker costed by the predictor refines its rates there; the others update their factor.
        """
        if not stage_times_ms:
            return
        cuts = [0, *self.block_cuts(manifest), len(self.analysis.blocks)]
        for k, worker in enumerate(workers):
            last = k == len(workers) - 1
            group = members[k] if members and k < len(members) else {}
            timed = group.items() if len(group) > 1 else [(worker, MemberTimes(*stage_times_ms[k], 1.0))]
            for name, times in timed:
                self._learn(name, cuts[k], cuts[k + 1], last, times)

    def _learn(self, worker: str, first: int, end: int, last: bool, times: MemberTimes) -> None:
        """One worker's measured ms per step on blocks ``[first, end)``, computing ``times.share`` of each
        micro-batch: the predictor's observation, or the worker's correction factor."""
        forward, backward, optimizer = (t / self.micro_batches for t in (times.forward_ms, times.backward_ms,
                                                                         times.optimizer_ms))
        if self._predicts(worker):
            self._observe_predicted(worker, first, end, forward, backward, last, times.share)
            return
        baseline = self._stage_work(worker, first, end, last, times.share)
        measured = forward + backward + optimizer
        if baseline > 0 and measured > 0:
            ratio = measured / baseline
            old = self._factor.get(worker)
            changed = old is None or not 1 / SPEED_CHANGE < ratio / old < SPEED_CHANGE
            self._factor[worker] = ratio if changed else (1 - SMOOTHING) * old + SMOOTHING * ratio

    def _observe_predicted(self, worker: str, first: int, end: int, forward: float, backward: float,
                           last: bool, share: float = 1.0) -> None:
        """One stage time for the predictor, in its terms: a backward call includes the forward it recomputes."""
        if backward <= 0 or (forward <= 0 and not last):
            return
        if self.stashing and not last:
            backward += forward
        features = join_features([f for u, f in enumerate(self._unit_features)
                                  if first <= self._units[u][0] and self._units[u][1] <= end])
        rows = max(1, round(self.micro_batch * share))
        self.predictor.observe(worker, features, rows, None if last else forward, backward)

    def use_profiles(self, profiles: list[DeviceProfile], blocks: tuple[str, ...]) -> None:
        """Cost the devices of ``profiles`` (timed on the units ``blocks``) by them from now on."""
        known = {d.name: d for d in (self.devices.devices if self.devices else ())}
        known.update({p.name: p for p in profiles})
        self.devices = DevicesFile(model_sha256=self.source.sha256, blocks=blocks,
                                   micro_batch=self.micro_batch, memory_mode=self.memory_mode,
            devices=tuple(known.values()), links=self.devices.links if self.devices else ())
        for profile in profiles:
            self._factor.pop(profile.name, None)  # measured now: no correction learnt against the old baseline
        self._fit_predictor()

    def record_pause(self, seconds: float, recut: bool = True) -> None:
        """The pause the latest re-partition took: a re-cut's, or (``recut`` False) a regroup's on the same cuts."""
        if recut:
            self._pause_s = seconds
        else:
            self._regroup_pause_s = seconds

    def problem(self, workers: list[str], allow_groups: bool = False):
        """The planner's view of the units and of the workers as measured so far; ``allow_groups``: a stage may
        be held by a data-parallel group of them."""
        from edgert.exporter.planner.solver import DeviceCosts, PlanProblem

        units = tuple(self._unit(u, a, e) for u, (a, e) in enumerate(self._units))
        devices = []
        for worker in workers:
            forward, backward, call, last_call = self._costs(worker)
            profile = self._profile(worker)
            peaks = tuple(t.peak_bytes for t in profile.blocks) if profile else (0,) * len(units)
            devices.append(DeviceCosts(name=worker, forward_ms=tuple(forward), backward_ms=tuple(backward),
                                       peak_bytes=peaks, memory_bytes=profile.memory_bytes if profile else 0,
                                       cores=profile.cores if profile else 1, call_ms=call,
                                       last_call_ms=last_call, **parallel_fractions(profile),
                                       weight_ms=self._weights(profile, worker, backward)))
        bandwidth, rtt = self._links(workers)
        slots = 2 if self.training.optimizer == "adamw" else int(bool(self.training.momentum))
        return PlanProblem(units=units, devices=tuple(devices), bandwidth=bandwidth, rtt_ms=rtt,
                           micro_batch=self.micro_batch, micro_batches=self.micro_batches, schedule=self.schedule,
                           optimizer_slots=slots, stash=self.stashing, allow_groups=allow_groups,
                           side_by_side=self.side_by_side, split_backward=self.split_backward)

    def _weights(self, profile: DeviceProfile | None, worker: str, backward: list[float]) -> tuple[float, ...]:
        """Of each unit's ``backward`` (as :meth:`_costs` gives it), the weight gradients a split backward computes
        once a step, as ``worker``'s profile measured them (profile_costs.profiled_weights)."""
        if profile is None:
            return ()
        return profiled_weights(profile, self.micro_batch / self.devices.micro_batch * self._factor.get(worker, 1.0),
                                backward)

    def _unit(self, index: int, first: int, end: int):
        from edgert.exporter.planner.solver import Unit

        blocks = self.analysis.blocks[first:end]
        crossing = self.analysis.inputs if first == 0 else self.analysis.cut_before(first).tensors
        return Unit(name="+".join(b.name for b in blocks), param_bytes=sum(b.param_bytes for b in blocks),
                    input_bytes=sum(t.bytes_per_sample for t in crossing),
                    saved_bytes=sum(b.output_bytes for b in blocks))

    def _profile(self, worker: str):
        """``worker``'s profile when it times exactly the planner's units, else None."""
        if self.devices is None:
            return None
        profile = next((d for d in self.devices.devices if d.name == worker), None)
        return profile if profile is not None and len(profile.blocks) == len(self._units) else None

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

    def propose(self, manifest: Manifest, workers: list[str] | None, force: bool = False,
                cuts: tuple[int, ...] | None = None, candidates: list[str] | None = None,
                steps_left: int | None = None, members: list[tuple[str, ...]] | None = None,
                allow_groups: bool = False) -> Proposal | None:
        """A better placement, or None when the current one (``workers`` by stage; ``members``: each stage's
        workers where groups hold stages) is good enough.

        The planner may order and use any of ``candidates`` (default: the current workers), and
        with ``allow_groups`` let a group of them hold a stage. ``workers`` is None when no
        placement runs (a recovery, a resume); then ``candidates``, however many, are required.
        Unless ``force``, ``steps_left`` (the steps the run still has to go) is required: the time
        a new placement saves is summed over them.
        """
        from edgert.exporter.planner.solver import plan

        if workers is None and not candidates:
            raise ValueError("propose needs candidates when there is no current placement")
        if not force and steps_left is None:
            raise ValueError("propose needs steps_left to weigh a gain against the pause")
        holders = None if workers is None else [tuple(m) for m in members or [(w,) for w in workers]]
        current = self._current_ms(manifest, holders, candidates or [])
        if cuts is not None:
            return Proposal(tuple(cuts), tuple(workers), 1.0, current, current, "forced")
        pool = list(candidates or workers)
        options = [self._option(plan(self.problem(pool, allow_groups)), manifest, holders)]
        if allow_groups and holders is not None and not force:
            options += self._grown(manifest, holders, [c for c in pool if not any(c in m for m in holders)])
        chosen = options[0] if force else min(options, key=lambda o: o.step_ms * steps_left + o.pause_s * 1000)
        new_cuts, new_members, proposed = chosen.cuts, chosen.members, chosen.step_ms
        new_workers = tuple(group[0] for group in new_members)
        gain = current / proposed if proposed > 0 else 1.0
        unchanged = (holders is not None and list(new_cuts) == self.block_cuts(manifest)
                     and [set(m) for m in new_members] == [set(m) for m in holders])
        self.last_check = {"current_ms": round(current, 2), "proposed_ms": round(proposed, 2),
                           "proposed_cuts": list(new_cuts), "proposed_workers": list(new_workers),
                           "predicted_gain": round(gain, 4) if gain != float("inf") else None,
                           "steps_left": steps_left}
        grouped = any(len(m) > 1 for m in new_members)
        if grouped:
            self.last_check["proposed_groups"] = {k: list(m) for k, m in enumerate(new_members) if len(m) > 1}
        if unchanged and not force:
            self.last_check["decision"] = "keep: the current placement is the best"
            return None
        if not force:
            refusal = self._refusal(gain, current, proposed, steps_left, chosen.pause_s)
            if refusal:
                self.last_check["decision"] = refusal
                return None
        reason = "forced" if force else (f"predicted step {current:.0f} -> {proposed:.0f} ms (x{gain:.3f}): "
                                         f"x{self.last_check['gain_over_steps_left']:.3f} over the {steps_left} "
                                         f"steps left, a {chosen.pause_s:.1f} s pause included")
        self.last_check["decision"] = "re-plan"
        return Proposal(new_cuts, new_workers, gain, current, proposed, reason,
                        members=new_members if grouped else (),
                        shares=tuple(tuple(stage.shares) for stage in chosen.placement.stages) if grouped else (),
                        link_codecs=self._measured_codecs(chosen))

    def _measured_codecs(self, option: _Option) -> tuple[str, ...]:
        """The planner's codec for each link whose every sender-receiver pair was measured (``devices.json``'s
        links); ``none`` where one was not: a codec chosen against the fallback bandwidth is a guess."""
        codecs = []
        for k, codec in enumerate(option.placement.link_codecs):
            pairs = [(a, b) for a in option.members[k] for b in option.members[k + 1]]
            measured = self.devices is not None and all(self.devices.link(a, b) for a, b in pairs)
            codecs.append(codec if measured else "none")
        return tuple(codecs)

    def _option(self, placement, manifest: Manifest, holders: list[tuple[str, ...]] | None) -> _Option:
        """The planner's placement as an option: a re-cut's pause, or a regroup's where the cuts stay."""
        cuts = tuple(self._units[u][0] for u in placement.cut_units())
        same_cuts = holders is not None and list(cuts) == self.block_cuts(manifest)
        return _Option(placement, cuts, tuple(tuple(stage.devices) for stage in placement.stages),
                       self._step_ms(placement), self._regroup_pause_s if same_cuts else self._pause_s)

    def _grown(self, manifest: Manifest, holders: list[tuple[str, ...]], idle: list[str]) -> list[_Option]:
        """The current cuts and groups with one ``idle`` worker added to one stage (a group grows, or a stage's
        one worker becomes a group of two): nothing re-cut, only the newcomer fetches state."""
        from edgert.exporter.planner.solver import evaluate

        cuts = tuple(self.block_cuts(manifest))
        options = []
        for worker in idle:
            problem = self.problem([*(w for m in holders for w in m), worker], allow_groups=True)
            for k in range(len(holders)):
                members = [m + (worker,) if j == k else m for j, m in enumerate(holders)]
                try:
                    placement = evaluate(problem, self._stages_of(manifest, members))
                except PlanError:
                    continue  # it does not fit in this stage's memory
                options.append(_Option(placement, cuts, tuple(members), self._step_ms(placement),
                                       self._regroup_pause_s))
        return options

    def _refusal(self, gain: float, current_ms: float, proposed_ms: float, steps_left: int,
                 pause_s: float) -> str | None:
        """Why a better placement is not worth moving to (None: it is): over the ``steps_left`` steps, its time
        plus the re-partition's pause beats the current placement's by less than the threshold."""
        now, then = current_ms * steps_left, proposed_ms * steps_left + pause_s * 1000
        gain_left = now / then if then > 0 else gain
        self.last_check["gain_over_steps_left"] = round(gain_left, 4) if gain_left != float("inf") else None
        if gain_left >= 1 + self.threshold - GAIN_TOLERANCE:
            return None
        return (f"keep: x{gain_left:.3f} over the {steps_left} steps left (step {current_ms:.0f} -> "
                f"{proposed_ms:.0f} ms, x{gain:.3f}, and a {pause_s:.2f} s pause), "
                f"below the threshold x{1 + self.threshold:.3f}")

    def _current_ms(self, manifest: Manifest, members: list[tuple[str, ...]] | None, candidates: list[str]) -> float:
        """The predicted step time of ``manifest``'s stages on ``members`` (each stage's workers); infinite when
        no placement runs, or when it no longer fits (a worker left)."""
        from edgert.exporter.planner.solver import evaluate

        if members is None or len(members) != len(manifest.stages):
            return float("inf")
        pool = list(dict.fromkeys([*(w for m in members for w in m), *candidates]))
        try:
            return self._step_ms(evaluate(self.problem(pool, any(len(m) > 1 for m in members)),
                                          self._stages_of(manifest, members)))
        except PlanError:
            return float("inf")

    def _step_ms(self, placement) -> float:
        """Time per batch: the bottleneck under async (no flush), the simulated window otherwise."""
        return placement.bottleneck_ms if self.schedule == Schedule.ASYNC else placement.predicted_step_ms

    def _stages_of(self, manifest: Manifest, members: list[tuple[str, ...]]) -> list[tuple[int, int, tuple[str, ...]]]:
        """The current stages as planner units ranges on their workers (a group's members)."""
        starts = {a: u for u, (a, _) in enumerate(self._units)}
        bounds = [0, *self.block_cuts(manifest), len(self.analysis.blocks)]
        units = [starts.get(b, len(self._units)) for b in bounds]
        return [(units[k], units[k + 1], tuple(group)) for k, group in enumerate(members)]
