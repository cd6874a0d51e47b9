"""The re-planner's device costs: profiles, the latency predictor for unprofiled workers, learning online."""

import dataclasses

import numpy as np
import pytest

from edgert.devices import BlockTiming, DeviceProfile, DevicesFile, save_devices
from edgert.exporter.planner.profile_costs import split_stage_cost
from edgert.exporter.planner.replanner import MemberTimes, Replanner
from edgert.manifest import load_manifest
from tests.zoo_plans import zoo_plan

MICRO_BATCH = 16


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return zoo_plan(tmp_path_factory.mktemp("replan"), 2, "mlp-deep")


def unit_truth(replanner: Replanner, slowness: float) -> list[tuple[float, float]]:
    """A device ``slowness`` times a reference one: forward, backward ms per unit at MICRO_BATCH.

    Linear in the unit's FLOPs and parameter bytes, with a per-call cost, as on a real CPU.
    """
    times = []
    for first, end in replanner._units:
        blocks = replanner.analysis.blocks[first:end]
        flops = sum(b.flops for b in blocks) * MICRO_BATCH
        params = sum(b.param_bytes for b in blocks)
        forward = 0.05 + flops * 4e-7 + params * 2e-7
        times.append((forward * slowness, (0.08 + 2.6 * forward) * slowness))
    return times


def profiled(replanner: Replanner, name: str, slowness: float) -> DeviceProfile:
    blocks = tuple(BlockTiming(block="+".join(b.name for b in replanner.analysis.blocks[a:e]), forward_ms=f,
                               backward_ms=b, optimizer_ms=0.01)
                   for (a, e), (f, b) in zip(replanner._units, unit_truth(replanner, slowness)))
    return DeviceProfile(name=name, blocks=blocks)


@pytest.fixture(scope="module")
def devices_json(plan, tmp_path_factory):
    replanner = Replanner(plan, load_manifest(plan), tmp_path_factory.mktemp("cache"), micro_batches=4)
    devices = DevicesFile(model_sha256=replanner.source.sha256, blocks=tuple(
        "+".join(b.name for b in replanner.analysis.blocks[a:e]) for a, e in replanner._units),
        micro_batch=MICRO_BATCH, devices=(profiled(replanner, "a", 1.0), profiled(replanner, "b", 2.0)))
    return save_devices(devices, tmp_path_factory.mktemp("devices") / "devices.json")


def stage_truth(replanner: Replanner, manifest, workers: list[str], slowness: dict[str, float], micro_batches: int):
    """What the ledger would report: per stage (forward, backward, optimizer) ms per step."""
    cuts = [0, *replanner.block_cuts(manifest), len(replanner.analysis.blocks)]
    reports = []
    for k, worker in enumerate(workers):
        truth = unit_truth(replanner, slowness[worker])
        units = [u for u, (a, e) in enumerate(replanner._units) if cuts[k] <= a and e <= cuts[k + 1]]
        last = k == len(workers) - 1
        forward = 0.0 if last else sum(truth[u][0] for u in units) * micro_batches
        backward = sum(truth[u][1] for u in units) * micro_batches
        reports.append((forward, backward, 0.01 * len(units)))
    return reports


def stage_prediction(replanner: Replanner, worker: str, manifest, k: int) -> float:
    cuts = [0, *replanner.block_cuts(manifest), len(replanner.analysis.blocks)]
    forward, backward, call, last_call = replanner._costs(worker)
    units = [u for u, (a, e) in enumerate(replanner._units) if cuts[k] <= a and e <= cuts[k + 1]]
    return sum(forward[u] + backward[u] for u in units) + call


def test_profiled_workers_cost_what_their_profile_says(plan, devices_json, tmp_path):
    replanner = Replanner(plan, load_manifest(plan), tmp_path, devices=devices_json, batch_size=64, micro_batches=4)
    forward, backward, _, _ = replanner._costs("b")
    truth = unit_truth(replanner, 2.0)
    assert forward == pytest.approx([f for f, _ in truth], rel=1e-9)
    assert not replanner._predicts("b")
    assert replanner._predicts("stranger")


def test_an_unprofiled_worker_is_predicted_then_learnt_online(plan, devices_json, tmp_path):
    """A worker nobody profiled, 4x slower than ``a``: after a few reported steps its stage costs are right."""
    manifest = load_manifest(plan)
    replanner = Replanner(plan, manifest, tmp_path, devices=devices_json, batch_size=64, micro_batches=4)
    slowness = {"a": 1.0, "c": 4.0}
    truth_c = sum(f + b for f, b, _ in stage_truth(replanner, manifest, ["c", "a"], slowness, 4)[:1]) / 4
    before = stage_prediction(replanner, "c", manifest, 0)
    assert abs(before / truth_c - 1) > 0.4  # the population (between a and b) does not know c is 4x slower
    for workers in (["c", "a"], ["a", "c"]) * 3:
        replanner.observe(manifest, workers, stage_truth(replanner, manifest, workers, slowness, 4), 0.0)
    after = stage_prediction(replanner, "c", manifest, 0)
    assert after == pytest.approx(truth_c, rel=0.15)
    assert replanner.predictor.devices["c"].observations == 6
    assert "c" not in replanner._factor  # learnt by the predictor, not double-corrected by a factor


def test_the_planner_gives_a_slow_unprofiled_worker_less_work(plan, devices_json, tmp_path):
    manifest = load_manifest(plan)
    replanner = Replanner(plan, manifest, tmp_path, devices=devices_json, batch_size=64, micro_batches=4,
                          threshold=0.0)
    slowness = {"a": 1.0, "c": 6.0}
    for _ in range(4):
        replanner.observe(manifest, ["a", "c"], stage_truth(replanner, manifest, ["a", "c"], slowness, 4), 0.0)
    proposal = replanner.propose(manifest, ["a", "c"], force=True)
    cuts = [0, *proposal.cuts, len(replanner.analysis.blocks)]
    share = {w: cuts[k + 1] - cuts[k] for k, w in enumerate(proposal.workers)}
    flops = [b.flops for b in replanner.analysis.blocks]
    work = {w: sum(flops[cuts[k]:cuts[k + 1]]) for k, w in enumerate(proposal.workers)}
    assert share["c"] >= 1
    assert work["a"] > 3 * work["c"], work  # ideal split is 6:1; equal cuts would be 1:1


def test_without_profiles_flops_stand_in_and_measurements_correct_them(plan, tmp_path):
    manifest = load_manifest(plan)
    replanner = Replanner(plan, manifest, tmp_path, batch_size=64, micro_batches=4)
    assert replanner.predictor is None
    workers = ["a", "b"]
    slowness = {"a": 1.0, "b": 3.0}
    reports = stage_truth(replanner, manifest, workers, slowness, 4)
    for _ in range(6):
        replanner.observe(manifest, workers, reports, 0.0)
    measured = [sum(r) / 4 for r in reports]
    cuts = [0, *replanner.block_cuts(manifest), len(replanner.analysis.blocks)]
    for k, worker in enumerate(workers):
        # the factor makes the stage as a whole right (its mix of forward and backward may still be off)
        predicted = replanner._stage_work(worker, cuts[k], cuts[k + 1], last=k == 1)
        assert predicted * replanner._factor[worker] == pytest.approx(measured[k], rel=0.05)
    assert np.isfinite(list(replanner._factor.values())).all()


def test_split_stage_cost_recovers_the_fixed_cost_of_a_stage():
    net = [1.0, 2.0, 3.0, 4.0]
    measured = [v + 0.5 for v in net]  # each unit measured alone pays 0.5 ms of calls
    costs = split_stage_cost(measured, measured, [0.1] * 4, (sum(net) + 0.5, sum(net) + 0.5, 0.4))
    assert costs.call == pytest.approx((0.5, 0.5, 0.0))
    assert costs.forward == pytest.approx(net)
    # never more than the cheapest unit, nothing without a whole-model time
    assert split_stage_cost([1.0, 9.0], [1.0, 9.0], [0, 0], (0.0, 0.0, 0.0)).call[0] == 1.0
    assert split_stage_cost([1.0, 2.0], [1.0, 2.0], [0, 0], None).call == (0.0, 0.0, 0.0)
    # a whole that costs more than its units: the excess is spread (the optimizer's by parameter bytes)
    costs = split_stage_cost([1.0, 2.0], [1.0, 2.0], [1.0, 1.0], (6.0, 3.0, 4.0), param_bytes=[300, 100])
    assert costs.call == (0.0, 0.0, 0.0)
    assert costs.forward == pytest.approx([2.0, 4.0])
    assert costs.optimizer == pytest.approx([2.5, 1.5])


def test_a_profiled_stage_costs_its_units_plus_one_fixed_cost(plan, tmp_path):
    """Profiles that over-count per-unit calls: the planner's cost of a many-unit stage is the measured one."""
    manifest = load_manifest(plan)
    replanner = Replanner(plan, manifest, tmp_path, batch_size=64, micro_batches=1, schedule="async")
    truth = unit_truth(replanner, 1.0)
    call = (0.3, 0.6, 0.0)
    blocks = tuple(BlockTiming(block="+".join(b.name for b in replanner.analysis.blocks[a:e]), forward_ms=f + call[0],
                               backward_ms=b + call[1]) for (a, e), (f, b) in zip(replanner._units, truth))
    whole = BlockTiming(block="all", forward_ms=sum(f for f, _ in truth) + call[0],
                        backward_ms=sum(b for _, b in truth) + call[1])
    devices = DevicesFile(model_sha256=replanner.source.sha256, blocks=tuple(t.block for t in blocks),
                          micro_batch=MICRO_BATCH, devices=(DeviceProfile(name="a", blocks=blocks, whole=whole),))
    path = save_devices(devices, tmp_path / "devices.json")
    replanner = Replanner(plan, manifest, tmp_path, devices=path, batch_size=MICRO_BATCH, micro_batches=1,
                          schedule="async")
    blocks_total = len(replanner.analysis.blocks)
    # the whole model as the last stage runs no separate forward: its backward call and the fixed costs
    assert replanner._stage_work("a", 0, blocks_total, last=True) == pytest.approx(whole.backward_ms, rel=1e-9)
    forward, backward, fixed, last_fixed = replanner._costs("a")
    assert fixed == pytest.approx(sum(call))
    assert last_fixed == pytest.approx(call[1] + call[2])  # as the last stage: no forward call
    assert sum(forward) == pytest.approx(whole.forward_ms - call[0], rel=1e-9)


def test_saved_bytes_bound_what_a_stashing_stage_keeps(plan, tmp_path):
    """The planner's saved activations per sample are at least what the stash split really keeps."""
    from edgert.manifest import TrainingConfig
    from edgert.stage import StageSession

    manifest = load_manifest(plan)
    replanner = Replanner(plan, manifest, tmp_path, micro_batches=4, memory_mode="stash")
    problem = replanner.problem(["a", "b"])
    first_stage_end = replanner.block_cuts(manifest)[0]
    units = [u for u, (a, e) in enumerate(replanner._units) if e <= first_stage_end]
    planned = sum(problem.units[u].saved_bytes for u in units)

    entry = manifest.stages[0]
    session = StageSession(entry, plan, TrainingConfig(), memory_mode="stash")
    rows = 8
    inputs = {t.name: np.random.default_rng(0).standard_normal((rows, *map(int, t.shape[1:]))).astype(np.float32)
              for t in entry.inputs}
    kept: dict[str, np.ndarray] = {}
    session.forward(inputs, kept)
    actual = sum(array.nbytes for array in kept.values()) / rows
    assert problem.stash and actual > 0
    assert actual <= planned <= 4 * actual, (actual, planned)  # an upper bound (2x on mlp-deep), not a wild one


def test_a_placement_for_more_workers_than_the_plan_has_stages(plan, devices_json, tmp_path):
    """A recovery or a resume with idle workers: every survivor is a candidate, none is a current stage."""
    manifest = load_manifest(plan)  # 2 stages
    replanner = Replanner(plan, manifest, tmp_path, devices=devices_json, batch_size=64, micro_batches=4)
    survivors = ["a", "b", "c", "d"]
    proposal = replanner.propose(manifest, None, force=True, candidates=survivors)
    assert proposal is not None and proposal.current_ms == float("inf")
    assert set(proposal.workers) <= set(survivors) and len(proposal.cuts) == len(proposal.workers) - 1
    # the current workers given as a placement that no longer matches the plan cost nothing and crash nothing
    assert replanner.propose(manifest, survivors, force=True, candidates=survivors) is not None


def test_a_gain_is_weighed_over_the_steps_left_pause_included(plan, devices_json, tmp_path):
    """The same better placement is taken with enough steps left to beat the threshold, pause included, and
    not with fewer; a gain equal to the threshold (up to rounding) is taken."""
    manifest = load_manifest(plan)
    replanner = Replanner(plan, manifest, tmp_path, devices=devices_json, batch_size=64, micro_batches=4)
    # "b" (2x slower) on the first stage, the fast "a" on the second: swapping them or re-cutting pays
    slowness = {"a": 1.0, "b": 2.0}
    for _ in range(3):
        replanner.observe(manifest, ["b", "a"], stage_truth(replanner, manifest, ["b", "a"], slowness, 4), 0.0)
    replanner.threshold = 0.0
    best = replanner.propose(manifest, ["b", "a"], steps_left=10**9)
    assert best is not None and best.gain > 1.1
    replanner.threshold, pause_ms = 0.1, 1000.0
    replanner.record_pause(pause_ms / 1000)
    # current x n >= 1.1 (proposed x n + pause)  <=>  n >= 1.1 pause / (current - 1.1 proposed)
    needed = 1.1 * pause_ms / (best.current_ms - 1.1 * best.proposed_ms)
    assert replanner.propose(manifest, ["b", "a"], steps_left=int(needed) - 1) is None
    decision = replanner.last_check["decision"]
    assert f"over the {int(needed) - 1} steps left" in decision and "below the threshold x1.100" in decision
    assert replanner.last_check["gain_over_steps_left"] < 1.1 < replanner.last_check["predicted_gain"]
    taken = replanner.propose(manifest, ["b", "a"], steps_left=int(needed) + 1)
    assert taken is not None and f"over the {int(needed) + 1} steps left" in taken.reason
    replanner.record_pause(0.0)
    replanner.threshold = best.gain - 1  # exactly the predicted gain: met, not missed by rounding
    assert replanner.propose(manifest, ["b", "a"], steps_left=1000) is not None
    replanner.threshold = best.gain - 1 + 1e-3
    assert replanner.propose(manifest, ["b", "a"], steps_left=1000) is None
    with pytest.raises(ValueError, match="steps_left"):
        replanner.propose(manifest, ["b", "a"])


@pytest.fixture(scope="module")
def three_devices(plan, tmp_path_factory):
    """Profiles of "a" (1x), "b" (2x slower) and "c" (1x), on the planner's units."""
    replanner = Replanner(plan, load_manifest(plan), tmp_path_factory.mktemp("cache"), micro_batches=4)
    devices = DevicesFile(model_sha256=replanner.source.sha256, blocks=tuple(
        "+".join(b.name for b in replanner.analysis.blocks[a:e]) for a, e in replanner._units),
        micro_batch=MICRO_BATCH, devices=tuple(profiled(replanner, name, slowness)
                                               for name, slowness in (("a", 1.0), ("b", 2.0), ("c", 1.0))))
    return save_devices(devices, tmp_path_factory.mktemp("devices") / "devices.json")


def test_an_idle_worker_may_join_a_stage_without_a_re_cut_when_that_costs_less(plan, three_devices, tmp_path):
    """With groups allowed, the re-planner weighs the planner's best placement (a re-cut's pause) against the
    current cuts with the idle worker added to a stage (a regroup's pause): the least time over the steps left."""
    manifest = load_manifest(plan)
    replanner = Replanner(plan, manifest, tmp_path, devices=three_devices, batch_size=64, micro_batches=4,
                          threshold=0.0)
    holders = [("a",), ("b",)]
    grown = replanner._grown(manifest, holders, ["c"])
    assert [o.members for o in grown] == [(("a", "c"), ("b",)), (("a",), ("b", "c"))]
    assert all(list(o.cuts) == replanner.block_cuts(manifest) for o in grown)
    best_grown = min(o.step_ms for o in grown)
    best = replanner.propose(manifest, ["a", "b"], candidates=["a", "b", "c"], steps_left=10**6, allow_groups=True)
    assert best is not None and best.proposed_ms <= best_grown + 1e-9
    assert list(best.cuts) != replanner.block_cuts(manifest)  # the planner's best re-cuts
    # a re-cut that costs a long pause loses to joining a stage: same cuts, "c" in a group, the regroup's pause
    replanner.record_pause(1e4, recut=True)
    replanner.record_pause(0.0, recut=False)
    joined = replanner.propose(manifest, ["a", "b"], candidates=["a", "b", "c"], steps_left=1000, allow_groups=True)
    assert joined is not None and list(joined.cuts) == replanner.block_cuts(manifest)
    assert "c" in {w for m in joined.stage_members() for w in m} and joined.members
    assert joined.proposed_ms == pytest.approx(best_grown)  # the same cuts on the same devices: the best grown one
    assert all(abs(sum(joined.shares[k]) - 1) < 1e-9 for k, m in enumerate(joined.members) if len(m) > 1)
    assert "a 0.0 s pause included" in joined.reason
    # without groups nothing joins a stage: a pipeline over the three, or nothing
    single = replanner.propose(manifest, ["a", "b"], candidates=["a", "b", "c"], steps_left=1000)
    assert single is None or not single.members


def test_a_group_members_own_times_and_share_teach_its_speed(plan, three_devices, tmp_path):
    """A stage held by "a" and "c" (each half of every micro-batch), "c" measured 3x slower than its profile:
    its factor learns 3, and "a"'s stays 1; the merged (slowest) time is not pinned on the holder of record."""
    manifest = load_manifest(plan)
    replanner = Replanner(plan, manifest, tmp_path, devices=three_devices, batch_size=64, micro_batches=4)
    cuts = [0, *replanner.block_cuts(manifest), len(replanner.analysis.blocks)]

    def member(worker, slowness, share):
        work = replanner._stage_work(worker, cuts[0], cuts[1], last=False, share=share) * slowness * 4
        return MemberTimes(0.0, work - 0.01, 0.01, share)  # per step: 4 micro-batches

    stage_1 = stage_truth(replanner, manifest, ["a", "b"], {"a": 1.0, "b": 2.0}, 4)[1]
    members = [{"a": member("a", 1.0, 0.5), "c": member("c", 3.0, 0.5)}, {}]
    replanner.observe(manifest, ["a", "b"], [(0.0, 99.0, 0.0), stage_1], 0.0, members)
    assert replanner._factor["c"] == pytest.approx(3.0, rel=1e-6)
    assert replanner._factor["a"] == pytest.approx(1.0, rel=1e-6)


def test_a_link_nobody_measured_gets_no_codec_from_a_guess(plan, three_devices, tmp_path, monkeypatch):
    """Devices with memory for 60% of the model (so it is cut), links so slow the planner compresses them: costed
    at the fallback bandwidth (nobody measured them) the planner's codec is a guess and the link gets none; a
    measured link keeps the planner's choice."""
    import edgert.exporter.planner.replanner as replanner_module
    from edgert.devices import LinkProfile, load_devices
    from edgert.exporter.planner.solver import evaluate

    monkeypatch.setattr(replanner_module, "FALLBACK_BANDWIDTH", 1e4)
    manifest = load_manifest(plan)
    profiled_devices = load_devices(three_devices)
    problem = Replanner(plan, manifest, tmp_path / "m", devices=three_devices).problem(["a"])
    whole = evaluate(problem, [(0, len(problem.units), ("a",))]).stages[0].memory_bytes
    small = dataclasses.replace(profiled_devices, devices=tuple(dataclasses.replace(d, memory_bytes=int(0.6 * whole))
                                                                for d in profiled_devices.devices))
    guessed = Replanner(plan, manifest, tmp_path / "a", devices=save_devices(small, tmp_path / "small.json"),
                        batch_size=64, micro_batches=4)
    proposal = guessed.propose(manifest, ["a", "b"], force=True)
    assert len(proposal.workers) > 1 and proposal.link_codecs == ("none",) * (len(proposal.workers) - 1)
    slow_links = tuple(LinkProfile(x.name, y.name, 1e4, 1.0) for x in small.devices for y in small.devices
                       if x is not y)
    linked = save_devices(dataclasses.replace(small, links=slow_links), tmp_path / "linked.json")
    known = Replanner(plan, manifest, tmp_path / "b", devices=linked, batch_size=64, micro_batches=4)
    chosen = known.propose(manifest, ["a", "b"], force=True)
    assert len(chosen.workers) > 1 and all(codec != "none" for codec in chosen.link_codecs), chosen
