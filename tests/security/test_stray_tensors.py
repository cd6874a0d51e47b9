"""Stray activations and gradients during a real secure run are refused (4.xx) and disturb nothing.

A worker takes ``/act`` only from the previous stage's credential and ``/grad`` only from the
next one's, for steps and micro-batches its run commands announced, with the manifest's shapes
and the micro-batch's batch size. Every refused request below is one an enrolled worker could
send; the disturbed run must end with exactly the parameters of an undisturbed one.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.manifest import load_manifest
from edgert.transport import BadRequest, Envelope, TensorClient
from edgert.transport.errors import Forbidden
from tests.running_coordinator import final_parameters

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH, MICRO = 40, 32, 2


def secure_run(cluster, plan: Path, out: Path, attack=None):
    """Train STEPS steps on w0..w2 over coaps+tcp; ``attack(urls, out)`` runs while it trains."""
    with LocalCluster(3, names=["w0", "w1", "w2"], credentials=cluster.workers[:3]) as workers:
        config = TrainConfig(plan_dir=plan, workers=tuple(workers.urls), out_dir=out, steps=STEPS, epochs=10,
                             batch_size=BATCH, micro_batches=MICRO, schedule="1f1b", listen="coaps+tcp://127.0.0.1:0",
                             keys=cluster.keys, progress=False)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.setdefault("summary", train(config)))
        thread.start()
        refusals = attack(workers.urls, out) if attack else {}
        thread.join(300)
    return result.get("summary"), final_parameters(out), refusals


def latest_step(out: Path) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            steps = [m["step"] for m in read_metrics(out) if m.get("type") == "step"]
        except (OSError, ValueError):
            steps = []
        if steps:
            return max(steps)
        time.sleep(0.05)
    raise AssertionError("training did not start")


def test_stray_tensors_are_refused_and_the_run_is_undisturbed(cluster, mlp_plan3, tmp_path):
    entry = load_manifest(mlp_plan3).stages[1]
    (act_spec,) = entry.inputs
    (grad_name,) = entry.output_gradients
    grad_spec = next(t for t in entry.outputs if t.name == grad_name)
    size = BATCH // MICRO

    def tensors(spec, batch=size):
        return {spec.name: np.ones([batch if d == "N" else int(d) for d in spec.shape], np.float32)}

    def attack(urls, out):
        refusals: dict[str, str] = {}
        step = min(latest_step(out) + 8, STEPS - 1)  # a step the stages expect and have not done yet

        async def send(name, credential, url, path, envelope):
            async with TensorClient(tls=cluster.tls(credential)) as client:
                with pytest.raises((Forbidden, BadRequest)) as caught:
                    await client.request("POST", url, path, envelope, retries=0, timeout=30)
            refusals[name] = str(caught.value)

        def act(stage, spec=act_spec, kind="activations", **fields):
            values = {"run_id": run_id, "step": step, "microbatch": 0, "stage": stage, **fields}
            return Envelope(kind, tensors=fields.pop("tensors", tensors(spec)),
                            **{k: v for k, v in values.items() if k != "tensors"})

        run_id = json.loads((out / "run.json").read_text())["run_id"]
        attacks = [
            ("act to the first stage", cluster.workers[1], urls[0], "act", act(0)),
            ("act from the next stage", cluster.workers[2], urls[1], "act", act(1)),
            ("act from a stranger worker", cluster.workers[3], urls[1], "act", act(1)),
            ("act of the wrong batch size", cluster.workers[0], urls[1], "act", act(1, tensors=tensors(act_spec, 3))),
            ("act for an unannounced step", cluster.workers[0], urls[1], "act", act(1, step=10_000)),
            ("act for a micro-batch too many", cluster.workers[0], urls[1], "act", act(1, microbatch=MICRO)),
            ("grad to the last stage", cluster.workers[1], urls[2], "grad",
             act(2, spec=grad_spec, kind="gradients")),
            ("grad from the previous stage", cluster.workers[0], urls[1], "grad",
             act(1, spec=grad_spec, kind="gradients")),
        ]

        async def all_of_them():
            for name, credential, url, path, envelope in attacks:
                await send(name, credential, url, path, envelope)

        asyncio.run(all_of_them())
        return refusals

    disturbed, disturbed_parameters, refusals = secure_run(cluster, mlp_plan3, tmp_path / "disturbed", attack)
    assert refusals["act to the first stage"].startswith("4.03 Forbidden: stage 0 takes no /act from a peer")
    assert "only from its previous stage's worker 'w0', not worker 'w2'" in refusals["act from the next stage"]
    assert "not worker 'w3'" in refusals["act from a stranger worker"]
    assert refusals["act of the wrong batch size"].startswith("4.00 Bad Request: /act: batch size 3; micro-batch 0")
    assert "which no run command covers" in refusals["act for an unannounced step"]
    assert f"micro-batch {MICRO} of step" in refusals["act for a micro-batch too many"]
    assert "stage 2 takes no /grad from a peer" in refusals["grad to the last stage"]
    assert "only from its next stage's worker 'w2', not worker 'w0'" in refusals["grad from the previous stage"]
    assert disturbed is not None and disturbed.steps == STEPS
    events = {m.get("event") for m in read_metrics(tmp_path / "disturbed")}
    assert not events & {"recovery", "failure"}

    undisturbed, parameters, _ = secure_run(cluster, mlp_plan3, tmp_path / "undisturbed")
    assert undisturbed.steps == STEPS
    assert sorted(parameters) == sorted(disturbed_parameters)
    for name, value in parameters.items():
        np.testing.assert_array_equal(disturbed_parameters[name], value, err_msg=name)
