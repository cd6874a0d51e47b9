"""Groups run: real workers on loopback train a plan whose placement.json puts a stage on a group of workers
that split every micro-batch, and the trained parameters equal one device's on the same batches."""

import dataclasses
import itertools
import json
import threading
import time

import numpy as np
import pytest

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.errors import TrainingError
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.profiling import profile_devices
from edgert.coordinator.runlog import read_metrics
from edgert.coordinator.stage_groups import check_splittable, member_rows, place_workers
from edgert.devices import load_devices, save_devices
from edgert.exporter.device_plan import PLACEMENT_NAME
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.planner.replanner import Replanner
from edgert.exporter.planner.solver import evaluate
from edgert.exporter.source import SOURCE_FILE
from edgert.groups import StageGroup
from edgert.manifest import TrainingConfig, load_manifest
from edgert.models import build_model, save_model
from edgert.protocol import JOIN, WEIGHTS
from edgert.transport import ClientConfig, Envelope, SyncClient
from edgert.weights import StageState, load_state
from tests.running_coordinator import free_port
from tests.zoo_plans import write_groups

pytestmark = pytest.mark.timeout(600)

A, B, C, D = (f"coap+tcp://10.0.0.{k}:5683" for k in range(1, 5))

STEPS = 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(5, log_dir=tmp_path_factory.mktemp("worker-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The mlp as one stage (the one device) and in three stages."""
    folder = tmp_path_factory.mktemp("plans")
    save_model(build_model("mlp"), folder / "mlp.onnx")
    training = TrainingConfig(learning_rate=0.05)
    export_plan(folder / "mlp.onnx", folder / "one", ExportOptions(stages=1, training=training))
    export_plan(folder / "mlp.onnx", folder / "three", ExportOptions(stages=3, training=training))
    return folder


def run(plan, workers, out, schedule, data="digits", memory_mode="recompute"):
    config = TrainConfig(plan_dir=plan, workers=tuple(workers), out_dir=out, data=data, steps=STEPS,
                         batch_size=64, micro_batches=4, schedule=schedule, listen="coap+tcp://127.0.0.1:0",
                         progress=False, memory_mode=memory_mode)
    return train(config)


def parameters(out, stages):
    values = {}
    for k in range(stages):
        values.update(load_state(out / "checkpoints" / "latest" / f"stage{k}.cbor").parameters)
    return values


def largest_relative_difference(trained, reference):
    """The largest ``|a - b| / |b|`` (norms) over the parameters, tensor by tensor."""
    assert trained.keys() == reference.keys()
    return max(float(np.linalg.norm(trained[n] - reference[n]) / max(np.linalg.norm(reference[n]), 1e-12))
               for n in reference)


def model_relative_difference(trained, reference):
    """``|a - b| / |b|`` of all the parameters together, as one vector."""
    assert trained.keys() == reference.keys()
    difference = np.sqrt(sum(float(np.sum((trained[n] - reference[n]) ** 2.0)) for n in reference))
    return difference / np.sqrt(sum(float(np.sum(reference[n] ** 2.0)) for n in reference))


@pytest.fixture(scope="module")
def one_device(mlp, cluster, tmp_path_factory):
    """The reference: 20 steps of the whole mlp on one worker, under each schedule."""
    out = tmp_path_factory.mktemp("one")
    reference = {}
    for schedule in ("gpipe", "1f1b"):
        assert run(mlp / "one", cluster.urls[:1], out / schedule, schedule).steps == STEPS
        reference[schedule] = parameters(out / schedule, 1)
    return reference


@pytest.mark.parametrize(("schedule", "layout", "shares"), [
    ("gpipe", (1, 2, 1), ((1.0,), (0.7, 0.3), (1.0,))),  # a group in the middle
    ("1f1b", (1, 2, 1), ((1.0,), (0.5, 0.5), (1.0,))),
    ("1f1b", (1, 1, 2), ((1.0,), (1.0,), (0.3, 0.7))),  # a group holding the loss
    ("gpipe", (1, 2, 2), ((1.0,), (0.7, 0.3), (0.4, 0.6))),  # two groups side by side: their row ranges cross
], ids=["gpipe-middle-70-30", "1f1b-middle-50-50", "1f1b-last-30-70", "gpipe-middle-and-last"])
def test_a_group_trains_the_same_parameters_as_one_device(mlp, cluster, one_device, tmp_path, schedule, layout,
                                                          shares):
    members = members_of(cluster.urls, layout)
    plan = tmp_path / "plan"
    export_plan(mlp / "mlp.onnx", plan, ExportOptions(stages=3, training=TrainingConfig(learning_rate=0.05)))
    write_groups(plan, members, shares)
    summary = run(plan, [url for group in members for url in group], tmp_path / "run", schedule)
    assert summary.steps == STEPS
    difference = largest_relative_difference(parameters(tmp_path / "run", 3), one_device[schedule])
    print(f"{schedule} {layout} {shares}: largest relative parameter difference {difference:.2e}")
    assert difference < 1e-5
    events = [m for m in read_metrics(tmp_path / "run") if m.get("type") == "event"]
    assert [sorted(map(int, event["groups"])) for event in events if event["event"] == "stages_assigned"] == \
        [[k for k, size in enumerate(layout) if size > 1]]
    # the members beyond each group's first hold a stage: not idle workers to weigh at placement checks
    assert not [event for event in events if event["event"] == "placement_check"]
    steps = [m for m in read_metrics(tmp_path / "run") if m.get("type") == "step"]
    assert len(steps) == STEPS
    for k, size in enumerate(layout):  # each step line has every member's own times; the last stage scores all rows
        members = [stage.get("members", []) for line in steps for stage in line["stages"] if stage["stage"] == k]
        assert all(len(m) == (size if size > 1 else 0) for m in members)
    if layout[-1] > 1:
        assert all(sum(m["samples"] for m in line["stages"][-1]["members"]) == 64 for line in steps)


def test_a_group_that_stashes_activations_trains_as_one_device(mlp, cluster, one_device, tmp_path):
    """``--memory-mode stash``: a member keeps what its forward saved for its own rows; 1f1b, 0.7/0.3 in the
    middle and 0.5/0.5 holding the loss."""
    members = members_of(cluster.urls, (1, 2, 2))
    plan = tmp_path / "plan"
    export_plan(mlp / "mlp.onnx", plan, ExportOptions(stages=3, training=TrainingConfig(learning_rate=0.05)))
    write_groups(plan, members, ((1.0,), (0.7, 0.3), (0.5, 0.5)))
    summary = run(plan, [url for group in members for url in group], tmp_path / "run", "1f1b", memory_mode="stash")
    assert summary.steps == STEPS
    difference = largest_relative_difference(parameters(tmp_path / "run", 3), one_device["1f1b"])
    print(f"stash, 1f1b (1, 2, 2): largest relative parameter difference {difference:.2e}")
    assert difference < 1e-5


def test_under_async_a_group_trains_as_its_stage_on_one_worker(mlp, cluster, tmp_path):
    """``async`` steps after every micro-batch with stashed weights, so it is compared with the same three stages
    on one worker each (one device runs another maths): a 0.6/0.4 group in the last stage changes nothing."""
    plan = tmp_path / "plan"
    export_plan(mlp / "mlp.onnx", plan, ExportOptions(stages=3, training=TrainingConfig(learning_rate=0.05)))
    run(plan, cluster.urls[:3], tmp_path / "plain", "async")
    members = members_of(cluster.urls, (1, 1, 2))
    write_groups(plan, members, ((1.0,), (1.0,), (0.6, 0.4)))
    assert run(plan, [url for group in members for url in group], tmp_path / "run", "async").steps == STEPS
    difference = largest_relative_difference(parameters(tmp_path / "run", 3), parameters(tmp_path / "plain", 3))
    print(f"async with a 0.6/0.4 group holding the loss: largest relative parameter difference {difference:.2e}")
    assert difference < 1e-5


def test_a_replan_from_a_group_placement_keeps_the_trained_state(mlp, cluster, one_device, tmp_path):
    """A re-plan forced at step 10 of a run with a 0.7/0.3 group in the middle places one worker per stage (the
    groups shrink away), moving the state from each stage's holder of record: 20 steps still equal one device's."""
    members = members_of(cluster.urls, (1, 2, 1))
    plan = tmp_path / "plan"
    export_plan(mlp / "mlp.onnx", plan, ExportOptions(stages=3, training=TrainingConfig(learning_rate=0.05)))
    write_groups(plan, members, ((1.0,), (0.7, 0.3), (1.0,)))
    summary = train(TrainConfig(plan_dir=plan, workers=tuple(url for group in members for url in group),
                                out_dir=tmp_path / "run", steps=STEPS, batch_size=64, micro_batches=4, schedule="1f1b",
                                listen="coap+tcp://127.0.0.1:0", progress=False, replan_at=((10, None),)))
    assert summary.steps == STEPS
    (replan,) = [m for m in read_metrics(tmp_path / "run") if m.get("event") == "replan"]
    stages = len(replan["new_cuts"]) + 1
    difference = largest_relative_difference(parameters(tmp_path / "run", stages), one_device["1f1b"])
    print(f"re-planned at step 10 onto {replan['workers']}: largest relative parameter difference {difference:.2e}")
    assert difference < 1e-5


def members_of(urls, layout):
    """``urls`` cut into groups of the ``layout``'s sizes."""
    members, urls = [], list(urls)
    for size in layout:
        members.append(tuple(urls[:size]))
        urls = urls[size:]
    return members


@pytest.mark.parametrize(("model", "training", "data", "schedule", "layout", "shares"), [
    ("mlp-deep", TrainingConfig(optimizer="sgd", learning_rate=3e-4), "digits", "1f1b", (1, 2, 1),
     ((1.0,), (0.6, 0.4), (1.0,))),
    ("transformer-mini", TrainingConfig(learning_rate=0.01), "tokens", "gpipe", (1, 2, 2),
     ((1.0,), (0.5, 0.5), (0.7, 0.3))),
])
def test_groups_train_deeper_models_as_one_device(cluster, tmp_path, model, training, data, schedule, layout,
                                                  shares):
    """Models without batch statistics: the 24-layer mlp and the transformer (LayerNorm, attention), compared as
    one parameter vector. Tensor by tensor they can differ more, as one device differs from itself when only the
    order of its float sums changes (docs/RUNTIME.md, "Groups"): the mlp-deep is chaotic at larger learning rates,
    and the keys' biases of attention have a gradient of exactly 0, whose rounding noise AdamW turns into steps."""
    save_model(build_model(model), tmp_path / "model.onnx")
    export_plan(tmp_path / "model.onnx", tmp_path / "one", ExportOptions(stages=1, training=training))
    export_plan(tmp_path / "model.onnx", tmp_path / "three", ExportOptions(stages=3, training=training))
    members = members_of(cluster.urls, layout)
    write_groups(tmp_path / "three", members, shares)
    run(tmp_path / "one", cluster.urls[:1], tmp_path / "reference", schedule, data)
    run(tmp_path / "three", [url for group in members for url in group], tmp_path / "run", schedule, data)
    trained, reference = parameters(tmp_path / "run", 3), parameters(tmp_path / "reference", 1)
    difference = model_relative_difference(trained, reference)
    print(f"{model} {schedule} {layout} {shares}: relative parameter difference {difference:.2e} (largest of a "
          f"tensor {largest_relative_difference(trained, reference):.2e})")
    assert difference < 1e-5


def test_the_members_of_a_batchnorm_group_end_with_the_same_state(cluster, tmp_path):
    """The cnn (BatchNorm) with a 0.7/0.3 group in the middle: not the one device's parameters (each member
    normalises with its own rows' statistics), but both members hold bitwise the same parameters, running
    statistics and optimizer state, and the run trains about as well."""
    save_model(build_model("cnn"), tmp_path / "cnn.onnx")
    training = TrainingConfig(learning_rate=3e-3)
    export_plan(tmp_path / "cnn.onnx", tmp_path / "one", ExportOptions(stages=1, training=training))
    export_plan(tmp_path / "cnn.onnx", tmp_path / "three", ExportOptions(stages=3, training=training))
    members = members_of(cluster.urls, (1, 2, 1))
    write_groups(tmp_path / "three", members, ((1.0,), (0.7, 0.3), (1.0,)))
    reference = run(tmp_path / "one", cluster.urls[:1], tmp_path / "reference", "1f1b")
    grouped = run(tmp_path / "three", [url for group in members for url in group], tmp_path / "run", "1f1b")
    with SyncClient.start(ClientConfig(timeout=30.0)) as client:
        states = [StageState.from_envelope(client.get(url, WEIGHTS).envelope()) for url in members[1]]
    names = set(states[0].parameters)
    assert {"conv2.bn.running_mean", "conv2.bn.running_var"} <= names or \
        {"conv3.bn.running_mean", "conv3.bn.running_var"} <= names
    for name in names:
        assert np.array_equal(states[0].parameters[name], states[1].parameters[name]), name
    assert states[0].optimizer and states[0].optimizer.keys() == states[1].optimizer.keys()
    for name, buffers in states[0].optimizer.items():
        assert all(np.array_equal(value, states[1].optimizer[name][buffer]) for buffer, value in buffers.items()), name
    difference = model_relative_difference(parameters(tmp_path / "run", 3), parameters(tmp_path / "reference", 1))
    print(f"cnn with a 0.7/0.3 group: relative parameter difference to one device {difference:.2e}, train loss "
          f"{grouped.train_loss:.4f} against {reference.train_loss:.4f}")
    assert grouped.train_loss == pytest.approx(reference.train_loss, rel=0.05)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_a_group_exchanges_its_gradients_in_the_runs_gradient_codec(mlp, cluster, one_device, tmp_path, codec):
    """``--grad-codec`` (every gradient that crosses the network): the members of a 0.7/0.3 group send each other
    their gradients compressed, and each adds its own part as the others decode it, so both still hold bitwise
    the same state; the run learns, no longer bit for bit one device's."""
    members = members_of(cluster.urls, (1, 2, 1))
    plan = tmp_path / "plan"
    export_plan(mlp / "mlp.onnx", plan, ExportOptions(stages=3, training=TrainingConfig(learning_rate=0.05)))
    write_groups(plan, members, ((1.0,), (0.7, 0.3), (1.0,)))
    config = TrainConfig(plan_dir=plan, workers=tuple(url for group in members for url in group),
                         out_dir=tmp_path / "run", steps=STEPS, batch_size=64, micro_batches=4, schedule="1f1b",
                         listen="coap+tcp://127.0.0.1:0", progress=False, backward_codec=codec)
    summary = train(config)
    assert summary.steps == STEPS
    with SyncClient.start(ClientConfig(timeout=30.0)) as client:
        states = [StageState.from_envelope(client.get(url, WEIGHTS).envelope()) for url in members[1]]
    for name, value in states[0].parameters.items():
        assert np.array_equal(value, states[1].parameters[name]), name
    difference = model_relative_difference(parameters(tmp_path / "run", 3), one_device["1f1b"])
    print(f"gradients in {codec}: relative parameter difference to one device {difference:.2e}, "
          f"test accuracy {summary.test_accuracy:.3f}")
    assert difference > 1e-5  # uncompressed groups end within 1e-5 of one device (above)
    assert summary.test_accuracy > 0.5


def test_a_run_is_refused_when_the_workers_do_not_match_the_groups(mlp, tmp_path):
    plan = tmp_path / "plan"
    export_plan(mlp / "mlp.onnx", plan, ExportOptions(stages=3))
    urls = [f"coap+tcp://127.0.0.1:{5700 + k}" for k in range(4)]
    write_groups(plan, [urls[:1], urls[1:3], urls[3:]], [(1.0,), (0.7, 0.3), (1.0,)])
    with pytest.raises(TrainingError, match=r"3 stages held by 4 worker\(s\) \(groups in placement.json: stage 1: 2\) "
                                            r"but 3 worker\(s\) were given"):
        train(TrainConfig(plan_dir=plan, workers=tuple(urls[:3]), out_dir=tmp_path / "out",
                          listen="coap+tcp://127.0.0.1:0", progress=False))
    write_groups(plan, [urls[:1], urls[1:3], urls[3:]], [(1.0,), (0.7, -0.3), (1.0,)])
    with pytest.raises(TrainingError, match=r"stage 1's group: group shares must be positive numbers: \[0.7, -0.3\]"):
        train(TrainConfig(plan_dir=plan, workers=tuple(urls), out_dir=tmp_path / "out3",
                          listen="coap+tcp://127.0.0.1:0", progress=False))
    placement = json.loads((plan / PLACEMENT_NAME).read_text())
    placement["stages"][1]["shares"] = [0.5, 0.3, 0.2]
    (plan / PLACEMENT_NAME).write_text(json.dumps(placement))
    with pytest.raises(TrainingError, match=r"stage 1 lists 2 device\(s\), 2 URL\(s\) and 3 share\(s\)"):
        train(TrainConfig(plan_dir=plan, workers=tuple(urls), out_dir=tmp_path / "out4",
                          listen="coap+tcp://127.0.0.1:0", progress=False))
    write_groups(plan, [urls[:1], urls[1:3], urls[3:]], [(1.0,), (0.7, 0.3), (1.0,)])
    with pytest.raises(TrainingError, match=r"a micro-batch of 1 sample\(s\) cannot be split across a group of 2"):
        train(TrainConfig(plan_dir=plan, workers=tuple(urls), out_dir=tmp_path / "out2", batch_size=4,
                          micro_batches=4, listen="coap+tcp://127.0.0.1:0", progress=False))


def test_the_coordinator_splits_workers_into_groups_and_each_member_gets_its_rows():
    order, groups = place_workers([A, B, C, D], [(1.0,), (0.7, 0.3), (1.0,)], {A: "a", B: "b", C: "c", D: "d"})
    assert order == [A, B, D] and groups[0] is None and groups[2] is None
    assert groups[1] == StageGroup((B, C), (0.7, 0.3), ("b", "c"))
    # a step of two micro-batches of 5 and 4 rows: member 1 owns rows 4 of the first and 3 of the second
    assert member_rows(groups[1], 1, [5, 4]).tolist() == [4, 8]
    assert member_rows(None, 0, [5, 4]).tolist() == list(range(9))
    rows = np.concatenate([member_rows(groups[1], j, [16, 16, 16, 16]) for j in range(2)])
    assert sorted(rows.tolist()) == list(range(64))  # the members' rows are the batch, once each
    with pytest.raises(TrainingError, match=r"stage 1's group: group members must be one or more distinct"):
        place_workers([A, B, B], [(1.0,), (0.5, 0.5)])
    check_splittable(groups, 8, 4, "1f1b")
    with pytest.raises(TrainingError, match=r"a micro-batch of 1 sample\(s\) cannot be split across a group of 2"):
        check_splittable(groups, 7, 4, "gpipe")


JOIN_STEPS = 400


def without_peaks(measured):
    """``measured`` with no working memory measured (the peaks of a few tiny sessions on a busy host are noise):
    a stage's memory is then what its parameters, optimizer state and held activations take."""
    def flat(timing):
        return None if timing is None else dataclasses.replace(timing, peak_bytes=0)
    return dataclasses.replace(measured, devices=tuple(
        dataclasses.replace(d, blocks=tuple(flat(t) for t in d.blocks), whole=flat(d.whole))
        for d in measured.devices))


def memory_for_three_stages(plan, devices) -> int:
    """A memory size (bytes) that holds each stage of ``plan`` (the mlp cut in three) on any device of ``devices``
    but no stage of any other cut of the mlp: boards on which the model fits only this way."""
    replanner = Replanner(plan, load_manifest(plan), plan.parent / "cache", devices=devices, batch_size=256,
                          micro_batches=4)
    problem = replanner.problem([d.name for d in load_devices(devices).devices], allow_groups=True)
    units = len(replanner._units)
    names = [d.name for d in problem.devices]

    def largest(cuts):  # the most any device needs for a stage of ``cuts``
        bounds = list(zip([0, *cuts], [*cuts, units]))
        return max(stage.memory_bytes for shift in range(len(names)) for stage in evaluate(
            problem, [(a, e, (names[(k + shift) % len(names)],)) for k, (a, e) in enumerate(bounds)]).stages)

    ours = tuple(u for u, (a, _) in enumerate(replanner._units) if a in replanner.block_cuts(load_manifest(plan)))
    others = [c for k in range(units) for c in itertools.combinations(range(1, units), k) if c != ours]
    cap = int(largest(ours) * 1.01)
    assert all(largest(c) > cap for c in others), "the mlp fits other cuts too: the test's premise is gone"
    return cap


def test_a_worker_that_joins_a_run_with_groups_joins_a_group_without_a_re_cut(mlp, tmp_path):
    """A fifth emulated board joins a run of groups (1, 2, 1) on the mlp, on boards whose memory holds the model
    only cut this way: the live re-planner, which costs groups, places it and re-forms the groups without a
    re-cut (no new plan; only the workers new to a stage fetch its state), and the run trains the same
    parameters as one device."""
    plan, one = tmp_path / "plan", tmp_path / "one-stage"
    training = TrainingConfig(learning_rate=0.01)  # 0.05 over 400 steps amplifies rounding to 30% (groups or not)
    export_plan(mlp / "mlp.onnx", plan, ExportOptions(stages=3, training=training))
    export_plan(mlp / "mlp.onnx", one, ExportOptions(stages=1, training=training))
    with LocalCluster(5, slowdowns=["8"] * 5, log_dir=tmp_path / "logs") as slow:
        measured = without_peaks(profile_devices(plan / SOURCE_FILE, slow.urls, micro_batch=64, repeats=2))
        cap = memory_for_three_stages(plan, save_devices(measured, tmp_path / "measured.json"))
        small = dataclasses.replace(measured, devices=tuple(dataclasses.replace(d, memory_bytes=cap)
                                                            for d in measured.devices))
        members = members_of(slow.urls, (1, 2, 1))
        write_groups(plan, members, ((1.0,), (0.5, 0.5), (1.0,)))
        listen = f"coap+tcp://127.0.0.1:{free_port()}"
        config = TrainConfig(plan_dir=plan, workers=tuple(url for group in members for url in group),
                             out_dir=tmp_path / "run", steps=JOIN_STEPS, epochs=100, batch_size=256, micro_batches=4,
                             schedule="1f1b", listen=listen, progress=False, replan_every=2,
                             devices=save_devices(small, tmp_path / "devices.json"))
        done = {}
        thread = threading.Thread(target=lambda: done.update(summary=train(config)))
        thread.start()
        while not [m for m in read_metrics_if_any(tmp_path / "run") if m.get("type") == "step"]:
            assert thread.is_alive()
            time.sleep(0.05)
        with SyncClient.start() as client:
            client.post(listen, JOIN, Envelope("control", meta={"url": slow.urls[4]}), timeout=60)
        thread.join(300)
        reference = TrainConfig(plan_dir=one, workers=(slow.urls[0],), out_dir=tmp_path / "one",
                                steps=JOIN_STEPS, epochs=100, batch_size=256, micro_batches=4, schedule="1f1b",
                                listen="coap+tcp://127.0.0.1:0", progress=False)
        assert train(reference).steps == JOIN_STEPS
    assert done["summary"].steps == JOIN_STEPS
    events = [m for m in read_metrics(tmp_path / "run") if m.get("type") == "event"]
    late = slow.names[4]
    assert [e["worker"] for e in events if e["event"] == "join"] == [late]
    (replan,) = [e for e in events if e["event"] == "replan"]
    assert replan["recut"] is False and replan["new_cuts"] == replan["old_cuts"]
    placed_on = [set(g["workers"]) for g in replan["groups"].values()] + [{w} for w in replan["workers"]]
    assert any(late in workers for workers in placed_on) and replan["groups"], replan  # groups re-formed
    (placed,) = [e for e in events if e["event"] == "join_placed"]
    assert placed["worker"] == late and placed["recut"] is False
    assert not (tmp_path / "run" / "plans").exists()  # nothing was re-cut
    difference = model_relative_difference(parameters(tmp_path / "run", 3), parameters(tmp_path / "one", 1))
    assert difference < 1e-5, difference


def read_metrics_if_any(out):
    try:
        return read_metrics(out)
    except FileNotFoundError:
        return []
