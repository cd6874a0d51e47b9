"""Every schedule, stage count and micro-batch count runs to the end on real workers.

A stage batches its step reports (at most every 20 ms) while the coordinator sends only
``lookahead`` steps ahead of the last reported one: a stage that held its reports while
waiting for the next batch would wait forever (issue 15, item 8). The model is the small
``mlp``, whose steps take a few milliseconds, so many steps finish within one report
interval; the run must still reach its last step. One set of worker processes serves
every combination.
"""

import pytest

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.exporter.export import ExportOptions, export_plan
from edgert.models import build_model, save_model
from edgert.schedule import SCHEDULES

pytestmark = pytest.mark.timeout(120)
STEPS = 12  # more than the coordinator's lookahead (8): steps must be reported for the run to go on
STAGES = (1, 2, 3, 4)
MICRO_BATCHES = (1, 2, 8)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlp")
    save_model(build_model("mlp"), folder / "mlp.onnx")
    for stages in STAGES:
        export_plan(folder / "mlp.onnx", folder / f"plan{stages}", ExportOptions(stages=stages))
    return {stages: folder / f"plan{stages}" for stages in STAGES}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(max(STAGES)) as running:
        yield running


@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", STAGES)
def test_run_reaches_its_last_step(plans, cluster, tmp_path, stages, schedule, micro_batches):
    out = tmp_path / "run"
    # a stalled run fails after step_timeout: far longer than any of these steps, even on a loaded host
    config = TrainConfig(plan_dir=plans[stages], workers=tuple(cluster.urls[:stages]), out_dir=out, steps=STEPS,
                         schedule=schedule, micro_batches=micro_batches, step_timeout=20.0,
                         listen="coap+tcp://127.0.0.1:0", progress=False)
    summary = train(config)
    assert summary.steps == STEPS
    assert sorted(m["step"] for m in read_metrics(out) if m["type"] == "step") == list(range(STEPS))


def test_many_micro_batches_on_a_slow_stage(plans, tmp_path):
    """32 micro-batches a step, 8 steps ahead, would be 512 messages for one stage's 256-message inbox:
    the coordinator feeds only as many steps ahead as fit, instead of being refused (5.03) until it gives up."""
    with LocalCluster(1, slowdowns=["100"]) as slow:
        config = TrainConfig(plan_dir=plans[1], workers=tuple(slow.urls), out_dir=tmp_path / "run", steps=6,
                             micro_batches=32, step_timeout=20.0, listen="coap+tcp://127.0.0.1:0", progress=False)
        assert train(config).steps == 6
