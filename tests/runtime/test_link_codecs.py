"""Per-link codecs: real workers on loopback send each link's tensors in the codec the plan's placement.json
gives it, the command line's codecs override the plan on every link, and the run records what each link used."""

import asyncio
import json
from dataclasses import asdict, replace

import numpy as np
import pytest

from edgert.cli.train import print_summary
from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.run_summary import RunSummary
from edgert.coordinator.runlog import read_metrics
from edgert.errors import FileFormatError
from edgert.exporter.device_plan import PLACEMENT_NAME, PlannedPlacement, PlannedStage, load_placement
from edgert.exporter.export import ExportOptions, export_plan
from edgert.manifest import TrainingConfig, load_manifest
from edgert.models import build_model, save_model
from edgert.protocol import ACT, DATA_KINDS, RUN, STAGE, Peers, Segment, StageAssignment
from edgert.run_settings import RunSettings
from edgert.transport import ClientConfig, Envelope, TensorClient, TensorServer
from tests.hand_driven_worker import end_hand_driven_run
from tests.running_coordinator import final_parameters

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(3, log_dir=tmp_path_factory.mktemp("worker-logs")) as running:
        yield running


def write_placement(plan_dir, workers, link_codecs):
    """A placement.json as `edgert plan` writes it, for the plan in ``plan_dir`` on ``workers``."""
    stages = tuple(PlannedStage(entry.index, entry.blocks, f"w{entry.index}", url, 1.0, 1, 1)
                   for entry, url in zip(load_manifest(plan_dir).stages, workers))
    placement = PlannedPlacement(stages=stages, link_codecs=tuple(link_codecs), link_ms=(1.0,) * len(link_codecs),
                                 bottleneck_ms=1.0, predicted_step_ms=10.0, unused_devices=(), schedule="1f1b",
                                 batch_size=64, micro_batches=4, memory_mode="recompute")
    (plan_dir / PLACEMENT_NAME).write_text(json.dumps(asdict(placement)))


@pytest.fixture(scope="module")
def plans(tmp_path_factory, cluster):
    """The cnn in 3 stages: ``bare`` without placement.json, ``int8_none`` planned int8 then none, and
    ``int8`` planned int8 on both links."""
    folder = tmp_path_factory.mktemp("plans")
    save_model(build_model("cnn"), folder / "cnn.onnx")
    options = ExportOptions(stages=3, training=TrainingConfig(learning_rate=3e-3))
    plans = {}
    for name, codecs in (("bare", None), ("int8_none", ("int8", "none")), ("int8", ("int8", "int8"))):
        export_plan(folder / "cnn.onnx", folder / name, options)
        if codecs is not None:
            write_placement(folder / name, cluster.urls, codecs)
        plans[name] = folder / name
    return plans


def run(plan, workers, out, **options):
    config = TrainConfig(plan_dir=plan, workers=tuple(workers), out_dir=out, data="digits",
                         listen="coap+tcp://127.0.0.1:0", progress=False, **options)
    return train(config)


def links_used(out):
    """The codecs of the run's ``links`` event, per link: (activations, gradients)."""
    events = [m for m in read_metrics(out) if m["type"] == "event" and m["event"] == "links"]
    assert len(events) == 1
    return [(link["forward"], link["backward"]) for link in events[0]["links"]]


def test_each_link_uses_the_codec_the_plan_gives_it(cluster, plans, tmp_path):
    planned = run(plans["int8_none"], cluster.urls, tmp_path / "planned", steps=8)
    assert links_used(tmp_path / "planned") == [("int8", "int8"), ("none", "none")]
    assert [(link["sender"], link["receiver"]) for link in planned.links] == list(zip(planned.workers,
                                                                                      planned.workers[1:]))
    bare = run(plans["bare"], cluster.urls, tmp_path / "bare", steps=8)
    assert links_used(tmp_path / "bare") == [("none", "none")] * 2  # no placement.json: as before
    # what the workers sent was quantised: the same steps, seed and data train other parameters
    quantised, exact = final_parameters(tmp_path / "planned"), final_parameters(tmp_path / "bare")
    assert any(not np.array_equal(quantised[name], exact[name]) for name in exact)
    assert planned.train_loss == pytest.approx(bare.train_loss, rel=0.05)


def test_the_next_stage_receives_activations_in_the_links_codec(cluster, plans):
    """A middle stage told ``next_codec: int8`` (and another codec for its gradients) sends int8 activations."""
    manifest = load_manifest(plans["bare"])
    entry = manifest.stages[1]
    files = {a.role: (plans["bare"] / a.path).read_bytes() for a in entry.artifacts}
    received = asyncio.run(activations_arriving(cluster.urls[1], entry, files, RunSettings(manifest.training)))
    assert received and set(received.values()) == {"int8"}


async def activations_arriving(worker, entry, files, settings):
    """The codecs of the first activations ``worker`` sends to a stand-in next stage, by tensor name."""
    arrived = asyncio.get_running_loop().create_future()

    async def on_act(request):
        if not arrived.done():
            arrived.set_result(dict(request.envelope.codecs))

    server = TensorServer("coap+tcp://127.0.0.1:0")
    server.add_resource(ACT, post=on_act, rt="edgert.act", kinds=(DATA_KINDS[ACT],))
    await server.start()
    client = TensorClient(ClientConfig(timeout=60.0))
    stand_in = server.urls[0]
    assignment = StageAssignment(run_id="links", entry=entry, stages=3, settings=settings,
                                 peers=Peers(stand_in, stand_in, stand_in, next_codec="int8", previous_codec="fp16"))
    (spec,) = entry.inputs
    shape = [4 if d == "N" else int(d) for d in spec.shape]  # one micro-batch of 4
    activations = Envelope(kind="activations", run_id="links", step=0, microbatch=0, stage=1,
                           tensors={spec.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)})
    try:
        await client.put(worker, STAGE, assignment.to_envelope(files))
        await client.send(worker, RUN, Segment("gpipe", 3, 0, 1, 8, 2).to_envelope("links"))
        await client.send(worker, ACT, activations)
        return await asyncio.wait_for(arrived, 30)
    finally:
        await end_hand_driven_run(client, worker, server)


def test_codecs_given_on_the_command_line_override_the_plan_on_every_link(cluster, plans, tmp_path):
    run(plans["int8_none"], cluster.urls, tmp_path / "fp16", steps=2, forward_codec="fp16")
    assert links_used(tmp_path / "fp16") == [("fp16", "int8"), ("fp16", "none")]  # gradients still planned
    run(plans["int8_none"], cluster.urls, tmp_path / "none", steps=8, forward_codec="none", backward_codec="none")
    assert links_used(tmp_path / "none") == [("none", "none")] * 2
    run(plans["bare"], cluster.urls, tmp_path / "bare", steps=8)
    exact, overridden = final_parameters(tmp_path / "bare"), final_parameters(tmp_path / "none")
    assert all(np.array_equal(exact[name], overridden[name]) for name in exact)  # nothing was quantised


def test_a_placement_with_a_bad_codec_is_refused_naming_it(plans, tmp_path):
    folder = tmp_path / "plan"
    folder.mkdir()
    data = json.loads((plans["int8_none"] / PLACEMENT_NAME).read_text())
    (folder / PLACEMENT_NAME).write_text(json.dumps({**data, "link_codecs": ["int8", "int9"]}))
    with pytest.raises(FileFormatError, match=r"placement.json: link_codecs must be codec specs.*int9"):
        load_placement(folder)
    assert load_placement(plans["bare"]) is None


def test_the_summary_names_each_links_codecs_unless_all_are_none(capsys):
    summary = RunSummary(run_dir="r", steps=1, epochs=1, samples=64, train_seconds=1.0, samples_per_s=64.0,
                         train_loss=1.0, test_loss=None, test_accuracy=None, workers=["a", "b"],
                         links=[{"link": 0, "sender": "a", "receiver": "b", "forward": "none", "backward": "none"}])
    print_summary(summary, as_json=False)
    assert "link 0" not in capsys.readouterr().out
    summary = replace(summary, links=[{**summary.links[0], "forward": "int8"}])
    print_summary(summary, as_json=False)
    assert "link 0 (a -> b): activations int8, gradients none" in capsys.readouterr().out


@pytest.mark.slow
def test_int8_on_every_link_is_within_one_point_of_uncompressed_on_digits(cluster, plans, tmp_path):
    compressed = run(plans["int8"], cluster.urls, tmp_path / "int8", epochs=5, seed=1)
    exact = run(plans["bare"], cluster.urls, tmp_path / "none", epochs=5, seed=1)
    assert links_used(tmp_path / "int8") == [("int8", "int8")] * 2
    print(f"test accuracy: int8 links {compressed.test_accuracy:.4f}, uncompressed {exact.test_accuracy:.4f}")
    assert exact.test_accuracy >= 0.9
    assert abs(compressed.test_accuracy - exact.test_accuracy) <= 0.01


def test_a_live_replan_gives_each_link_the_codec_the_planner_chooses(cluster, plans, tmp_path):
    """The profiled workers' links measured at 200 kB/s, each with memory for 60% of the model: a re-plan (forced
    at step 4, to the planner's placement) cuts the model in at least two and sends the new stages the planner's
    compressing codec on each link, and records it."""
    from edgert.coordinator.profiling import profile_devices
    from edgert.devices import LinkProfile, save_devices
    from edgert.exporter.planner.replanner import Replanner
    from edgert.exporter.planner.solver import evaluate
    from edgert.exporter.source import SOURCE_FILE

    measured = profile_devices(plans["bare"] / SOURCE_FILE, cluster.urls, repeats=1)
    flat = tuple(replace(d, blocks=tuple(replace(t, peak_bytes=0) for t in d.blocks),
                         whole=d.whole and replace(d.whole, peak_bytes=0)) for d in measured.devices)
    slow = replace(measured, devices=flat, links=tuple(LinkProfile(a.name, b.name, 2e5, 5.0)
                                                       for a in flat for b in flat if a is not b))
    replanner = Replanner(plans["bare"], load_manifest(plans["bare"]), tmp_path / "cache",
                          devices=save_devices(slow, tmp_path / "measured.json"))
    problem = replanner.problem([flat[0].name])
    whole = evaluate(problem, [(0, len(problem.units), (flat[0].name,))]).stages[0].memory_bytes
    small = replace(slow, devices=tuple(replace(d, memory_bytes=int(0.6 * whole)) for d in flat))
    out = tmp_path / "run"
    summary = run(plans["bare"], cluster.urls, out, steps=8, devices=save_devices(small, tmp_path / "devices.json"),
                  replan_at=((4, None),))
    assert summary.steps == 8 and summary.replans == 1
    events = [m for m in read_metrics(out) if m["type"] == "event" and m["event"] == "links"]
    assert [e.get("before_step") for e in events] == [None, 4]
    assert {(link["forward"], link["backward"]) for link in events[0]["links"]} == {("none", "none")}
    after = [(link["forward"], link["backward"]) for link in events[1]["links"]]
    assert after and all(forward == backward != "none" for forward, backward in after), after
