"""A real coordinator answers every bad request with a 4.xx naming the problem, and its run goes on unchanged.

Over a thousand bad requests (every resource, every method, every body kind: none, random
bytes, other CBOR, another Content-Format, an envelope of another kind, of another run, and
the resource's own envelope with one thing wrong) reach a coordinator while it trains a
3-stage plan on three worker processes. Every answer is a 4.xx with a reason (never a 2.xx,
never a 5.xx), and the run ends with exactly the parameters of an undisturbed run.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgert.coordinator.coordinator import TrainConfig
from edgert.coordinator.localcluster import LocalCluster
from edgert.errors import ProtocolError
from edgert.manifest import load_manifest
from edgert.protocol import StageReports, StepReport, reports_to_envelope
from edgert.transport import ClientConfig, TensorClient
from tests.fuzz_bodies import BODY_KINDS, METHODS, broken, envelope_bytes, generic_body, misrouted
from tests.running_coordinator import RunningCoordinator, final_parameters

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH, MICRO = 120, 16, 2  # the fuzzing takes a few steps' time
REQUESTS = 1200
NOWHERE = "coap+tcp://127.0.0.1:9"
COORDINATOR_ROUTES = {".well-known/core": ("GET",), "report": ("POST",), "replica": ("PUT",), "join": ("POST",),
                      "weights": ("FETCH",)}
KIND_OF = {"report": "report", "replica": "weights", "join": "control", "weights": "control"}
NOT_REAL = [None, True, "x", b"\x00", [], {}]
REPORT_ROW = {**asdict(StepReport(step=2, stage=1, samples=8, loss_sum=1.0, correct=3, forward_ms=1.0)),
              "spans": [["F2.0", 0.5, 0.001]]}
WRONG_IN_ROW = {"correct": [True, -1, 1.5, "x", []], "spans": [5, "x", [["F", 1.0]], [[5, 1.0, 1.0]],
                                                              [["F", "a", 1.0]], [None]],
                **{name: NOT_REAL + [float("nan")] for name, value in REPORT_ROW.items()
                   if isinstance(value, float) and name != "loss_sum"}, "loss_sum": NOT_REAL}


@st.composite
def wrong_content(draw, path: str, run_id: str, parameters: list[str]) -> bytes:
    """The resource's own envelope, of this run, with exactly one thing wrong."""
    if path == "report":
        how = draw(st.sampled_from(["row", "row", "row", "stage", "rows", "failed", "worker", "unknown"]))
        row, stage, meta = dict(REPORT_ROW), 1, {"worker": "w1"}
        if how == "row":
            row = broken(draw, row, optional=tuple(k for k in row if k not in ("step", "stage")), wrong=WRONG_IN_ROW)
        elif how == "stage":
            stage = row["stage"] = draw(st.sampled_from([3, 7, 2**40]))
        elif how == "unknown":
            row["extra"] = 1
        meta["reports"] = draw(st.sampled_from([5, "x", {}, [5], [None]])) if how == "rows" else [row]
        if how == "failed":
            meta = {"worker": "w1", "failed": draw(st.sampled_from([None, 5, b"x", ["x"], {}]))}
        elif how == "worker":
            meta["worker"] = draw(st.sampled_from([5, None, ["w1"], b"w1"]))
        if how == "stage" and draw(st.booleans()):
            row["stage"] = 1  # the rows and the envelope disagree
        return envelope_bytes("report", run_id, step=2, stage=stage, meta=meta)
    if path == "replica":  # a plan of 3 stages; steps up to 3 are sent before the fuzzing starts
        stage, step = draw(st.sampled_from([(3, 3), (100, 3), (2**40, 3), (0, 10**9), (1, 2**40)]))
        return envelope_bytes("weights", run_id, step=step, stage=stage, meta={"origin": "w0"},
                              tensors={parameters[0]: np.zeros(4, np.float32)})
    if path == "join":
        return envelope_bytes("control", run_id, meta=draw(st.sampled_from([
            {}, {"url": 5}, {"url": "http://x:1"}, {"url": "coap+tcp://"}, {"url": ["a"]}, {"url": None},
            {"url": NOWHERE, "name": 5}, {"url": "coap+tcp://127.0.0.1:99999"}])))
    # FETCH /weights: the coordinator serves only its copies, by step and names
    meta = draw(st.sampled_from([
        "broken", "broken", "no step", "previous", "no copy", "unknown name"]))
    valid = {"names": parameters[:2], "copy_step": 9}
    meta = (broken(draw, valid) if meta == "broken" else {"names": parameters[:2]} if meta == "no step"
            else {**valid, "previous": True} if meta == "previous" else {**valid, "copy_step": 10**9}
            if meta == "no copy" else {**valid, "names": ["zz-unknown"]})
    return envelope_bytes("control", run_id, meta=meta)


@st.composite
def bad_requests(draw, run_id: str, parameters: list[str]):
    """(path, method, payload, Content-Format): every one of them wrong for a reason."""
    path = draw(st.sampled_from(sorted(COORDINATOR_ROUTES)))
    allowed = COORDINATOR_ROUTES[path]
    if path == ".well-known/core":  # it takes any payload: only another method is wrong
        return path, draw(st.sampled_from([m for m in METHODS if m not in allowed])), b"", None
    if draw(st.integers(0, 3)) == 0:  # a quarter of them with a method the resource lacks, or a GET
        method, payload, content_format = misrouted(draw, allowed)
        if payload is not None:
            return path, method, payload, content_format
    method = allowed[0]
    kind = draw(st.sampled_from(BODY_KINDS))
    if kind == "run" and path == "join":  # a join names no run
        kind = "content"
    if kind != "content":
        return (path, method, *generic_body(draw, kind, KIND_OF[path], run_id))
    return path, method, draw(wrong_content(path, run_id, parameters)), None


def draw_requests(run_id: str, parameters: list[str], count: int) -> list[tuple]:
    """``count`` bad requests, drawn (deterministically) before the run they are sent to begins."""
    drawn: list[tuple] = []

    @given(bad_requests(run_id, parameters))
    @settings(deadline=None, max_examples=count, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def collect(request):
        drawn.append(request)

    collect()
    return drawn


async def fire(url: str, requests: list[tuple], parallel: int = 8) -> list[tuple]:
    """Send every request (``parallel`` at a time); (path, method, code, reason, payload) of each answer."""
    gate = asyncio.Semaphore(parallel)
    async with TensorClient(ClientConfig(timeout=60.0, retries=0)) as client:
        async def one(path, method, payload, content_format):
            async with gate:
                response = await client.request(method, url, path, payload, content_format=content_format,
                                                raise_for_status=False)
            return path, method, response.code.dotted, response.text, payload[:120]

        return await asyncio.gather(*(one(*request) for request in requests))


def config(plan, workers: LocalCluster, out) -> TrainConfig:
    return TrainConfig(plan_dir=plan, workers=tuple(workers.urls), out_dir=out, steps=STEPS, epochs=100,
                       batch_size=BATCH, micro_batches=MICRO, schedule="1f1b", progress=False, central_every=10,
                       replicate_every=10, listen="coap+tcp://127.0.0.1:0")


def test_a_coordinator_answers_every_bad_request_with_a_4xx_and_trains_on(mlp_plan3, tmp_path):
    parameters = [p.name for entry in load_manifest(mlp_plan3).stages for p in entry.parameters]
    with LocalCluster(3) as workers:
        running = RunningCoordinator(config(mlp_plan3, workers, tmp_path / "fuzzed"))
        requests = draw_requests(running.run_id, parameters, REQUESTS)
        url = running.start().wait_training(announced=3)
        answers = asyncio.run(fire(url, requests))
        still_training = running.thread.is_alive()
        fuzzed = running.finish()
    codes = collections.Counter((path, method, code[0]) for path, method, code, _, _ in answers)
    assert len(answers) >= 1000 and still_training, (len(answers), "the run ended before the fuzzing did")
    wrong = [a for a in answers if not a[2].startswith("4.") or not a[3]]
    assert not wrong, wrong[:5]
    tried = {(path, method) for path, method, _ in codes}
    assert tried == {(path, method) for path in COORDINATOR_ROUTES for method in METHODS} - {(".well-known/core",
                                                                                               "GET")}
    assert fuzzed.steps == STEPS

    with LocalCluster(3) as workers:
        undisturbed = RunningCoordinator(config(mlp_plan3, workers, tmp_path / "undisturbed")).start().finish()
    assert undisturbed.steps == STEPS
    expected, got = final_parameters(tmp_path / "undisturbed"), final_parameters(tmp_path / "fuzzed")
    assert sorted(got) == sorted(expected) and expected
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_step_report_keeps_its_types_and_a_diverging_loss_is_still_recorded():
    report = StepReport(step=4, stage=1, samples=16, loss_sum=float("nan"), correct=None, forward_ms=2.5,
                        spans=[("F4.0", 0.25, 0.5)])
    message = StageReports.from_envelope(reports_to_envelope("r", 1, "w1", [report]))
    assert message.stage == 1 and message.worker == "w1" and message.failed is None
    (got,) = message.reports
    assert np.isnan(got.loss_sum) and (got.step, got.samples, got.correct, got.spans) == (4, 16, None,
                                                                                           [("F4.0", 0.25, 0.5)])
    bad = reports_to_envelope("r", 1, "w1", [report])
    bad.meta["reports"][0]["samples"] = 16.0
    with pytest.raises(ProtocolError, match=r"meta.reports\[0\].samples: expected an integer, got 16.0"):
        StageReports.from_envelope(bad)
