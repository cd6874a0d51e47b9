"""A failed group member is dropped and its share re-spread over its group, with no re-cut (Asteroid): real
workers on loopback, a real SIGKILL, and the trained parameters of an undisturbed run."""

import pytest

from edgert.bench.faults import run_and_kill
from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.coordinator.stage_groups import without_failed
from edgert.exporter.export import ExportOptions, export_plan
from edgert.groups import StageGroup
from edgert.manifest import TrainingConfig
from edgert.models import build_model, save_model
from tests.runtime.test_groups_train import largest_relative_difference, members_of, parameters
from tests.zoo_plans import write_groups

STEPS = 30
SHARES = ((1.0,), (0.5, 0.5), (1.0,))
A, B, C, D = (f"coap+tcp://10.0.0.{k}:5683" for k in range(1, 5))


def test_without_failed_re_spreads_a_group_and_gives_up_on_an_emptied_stage():
    groups = [None, StageGroup((B, C, D), (0.5, 0.25, 0.25), ("b", "c", "d")), None]
    order, kept = without_failed([A, B, A], groups, {C})
    assert order == [A, B, A] and kept[0] is None and kept[2] is None
    assert kept[1].members == (B, D) and kept[1].shares == (0.5, 0.25) and kept[1].names == ("b", "d")
    assert kept[1].ranges(12) == [(0, 8), (8, 12)]  # 2:1, as the shares left say
    order, kept = without_failed([A, B, A], groups, {B, C})  # the holder of record failed: the next one holds
    assert order[1] == D and kept[1] is None
    assert without_failed([A, B, A], groups, {B, C, D}) is None  # the stage is empty: re-cut
    assert without_failed([A, B, A], [None, None, None], {B}) is None  # no group: today's recovery
    assert without_failed([A, B, A], groups, {"coap+tcp://10.0.0.9:5683"}) is None  # an idle worker failed


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("group-failure")
    save_model(build_model("mlp"), folder / "mlp.onnx")
    export_plan(folder / "mlp.onnx", folder / "plan",
                ExportOptions(stages=3, training=TrainingConfig(learning_rate=0.05)))
    return folder / "plan"


def run(plan, workers, out):
    return train(TrainConfig(plan_dir=plan, workers=tuple(workers), out_dir=out, steps=STEPS, epochs=10,
                             batch_size=64, micro_batches=4, schedule="1f1b", replicate_every=5, central_every=10,
                             listen="coap+tcp://127.0.0.1:0", progress=False))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("victim", [2, 1], ids=["a-member", "the-holder-of-record"])
def test_a_killed_group_member_is_dropped_without_a_re_cut(plan, tmp_path, victim):
    with LocalCluster(4, log_dir=tmp_path / "logs") as cluster:
        members = members_of(cluster.urls, (1, 2, 1))
        write_groups(plan, members, SHARES)
        workers = [url for group in members for url in group]
        clean = run(plan, workers, tmp_path / "clean")
        outcome = run_and_kill(lambda: run(plan, workers, tmp_path / "killed"), cluster, tmp_path / "killed",
                               [victim], lambda health, step: step >= 8)
    assert clean.steps == outcome.result.steps == STEPS
    (recovery,) = [m for m in read_metrics(tmp_path / "killed") if m.get("event") == "recovery"]
    assert recovery["regrouped"] is True and recovery["failed"] == [cluster.urls[victim]]
    assert "groups" not in recovery  # the group of two is one worker now
    assert recovery["new_cuts"] == [m for m in read_metrics(tmp_path / "killed")
                                    if m.get("event") == "stages_assigned"][0]["cuts"]
    assert not (tmp_path / "killed" / "plans").exists()  # nothing was re-planned or built
    assert recovery["steps_lost"] <= 5 + 1
    # the lost shares were replayed from the snapshot: the same parameters as the undisturbed run
    assert largest_relative_difference(parameters(tmp_path / "killed", 3), parameters(tmp_path / "clean", 3)) < 1e-5
