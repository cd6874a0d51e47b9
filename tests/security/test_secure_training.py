"""An enrolled cluster trains over coaps+tcp while hostile peers are refused; then 10,000 hostile requests."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
import re
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.exporter.export import ExportOptions, export_plan
from edgert.manifest import TrainingConfig, load_manifest, needed_roles
from edgert.models import build_model, save_model
from edgert.protocol import STAGE, Peers, StageAssignment
from edgert.run_settings import RunSettings
from edgert.security.admission import StageSigning
from edgert.transport import Envelope, PeerUnreachable, TensorClient, encode_envelope
from edgert.transport.errors import Forbidden, TooLarge, Unauthorized
from edgert.transport.limits import MiB
from edgert.transport.tls import OscoreRoot, read_oscore
from tests.resident_memory import resident_bytes
from tests.zoo_plans import zoo_plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 60
FUZZ_REQUESTS = 10_000


@pytest.fixture(scope="module")
def plan3(tmp_path_factory) -> Path:
    return zoo_plan(tmp_path_factory.mktemp("secure"), 3)


@pytest.fixture(scope="module")
def trained(cluster, plan3, tmp_path_factory):
    """A secure run of STEPS steps on w0..w2, with hostile requests made while it trains."""
    out = tmp_path_factory.mktemp("secure-run") / "run"
    logs = tmp_path_factory.mktemp("secure-logs")
    with LocalCluster(3, names=["w0", "w1", "w2"], credentials=cluster.workers[:3], log_dir=logs) as workers:
        config = TrainConfig(plan_dir=plan3, workers=tuple(workers.urls), out_dir=out, steps=STEPS, epochs=10,
                             listen="coaps+tcp://127.0.0.1:0", keys=cluster.keys, progress=False,
                             replicate_every=10, central_every=10)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.setdefault("summary", train(config)))
        thread.start()
        deadline = time.monotonic() + 120
        while not any(m.get("type") == "step" for m in _metrics(out)):
            assert thread.is_alive() and time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        refusals = asyncio.run(_attack_while_training(cluster, plan3, workers.urls))
        thread.join(300)
        yield {"summary": result.get("summary"), "refusals": refusals, "out": out, "logs": logs,
               "workers": workers}


def _metrics(out: Path) -> list[dict]:
    try:
        return read_metrics(out)
    except (OSError, ValueError):
        return []


def _stage_envelope(plan: Path, index: int, tamper_graph: bool = False) -> Envelope:
    manifest = load_manifest(plan)
    entry = manifest.stages[index]
    roles = needed_roles(entry, "recompute")
    files = {a.role: (plan / a.path).read_bytes() for a in entry.artifacts if a.role in roles}
    if tamper_graph:  # a graph with a custom op domain, hashed into the entry as a compromised host would
        model = onnx.load_from_string(files["backward"])
        model.graph.node[0].domain = "evil.ops"
        files["backward"] = model.SerializeToString()
        artifacts = tuple(dataclasses.replace(a, sha256=hashlib.sha256(files["backward"]).hexdigest())
                          if a.role == "backward" else a for a in entry.artifacts)
        entry = dataclasses.replace(entry, artifacts=artifacts)
    assignment = StageAssignment(run_id="attack", entry=entry, stages=len(manifest.stages),
                                 peers=Peers(None, None, "coaps+tcp://127.0.0.1:9"),
                                 settings=RunSettings(manifest.training))
    return assignment.to_envelope(files)


async def _attack_while_training(cluster, plan, urls) -> dict[str, str]:
    """Each hostile request in turn; returns its refusal text by name."""
    target = urls[1]
    signing = StageSigning(cluster.store.sign, cluster.store.crl_pem)
    refusals: dict[str, str] = {}

    async def refused(name: str, tls, error: type[Exception], method: str, path: str, payload=None) -> None:
        async with TensorClient(tls=tls) as client:
            with pytest.raises(error) as caught:
                await client.request(method, target, path, payload, retries=0, timeout=60)
        refusals[name] = str(caught.value)

    await refused("unenrolled", cluster.anonymous(), Unauthorized, "GET", "health")
    await refused("revoked", cluster.tls(cluster.revoked), Unauthorized, "PUT", STAGE, _stage_envelope(plan, 1))
    await refused("foreign", cluster.tls(cluster.stranger), PeerUnreachable, "GET", "health")
    await refused("worker_commands", cluster.tls(cluster.workers[3]), Forbidden, "PUT", STAGE,
                  signing.apply(_stage_envelope(plan, 1)))
    tampered = signing.apply(_stage_envelope(plan, 1))
    tampered.meta["settings"]["training"]["learning_rate"] += 10
    await refused("tampered_manifest", cluster.coordinator, Forbidden, "PUT", STAGE, tampered)
    await refused("unsigned_manifest", cluster.coordinator, Forbidden, "PUT", STAGE, _stage_envelope(plan, 1))
    await refused("forbidden_domain", cluster.coordinator, Forbidden, "PUT", STAGE,
                  signing.apply(_stage_envelope(plan, 1, tamper_graph=True)))
    huge = Envelope("activations", run_id="x", tensors={"x": np.zeros(65 * MiB // 4 + 1, np.float32)})
    await refused("oversized", cluster.tls(cluster.workers[3]), TooLarge, "POST", "act", huge)
    return refusals


def test_an_enrolled_cluster_trains_over_tls(trained):
    summary = trained["summary"]
    assert summary is not None and summary.steps == STEPS
    assert summary.test_accuracy is not None and summary.test_accuracy > 0.6
    events = [m.get("event") for m in read_metrics(trained["out"])]
    assert "recovery" not in events and "failure" not in events  # the attacks disturbed nothing


@pytest.mark.parametrize("name, text", [
    ("unenrolled", "4.01 Unauthorized: no cluster credential"),
    ("revoked", "4.01 Unauthorized: the credential of worker 'gone' is revoked"),
    ("foreign", "TLS handshake"),
    ("worker_commands", "4.03 Forbidden: worker 'w3' may not PUT /stage"),
    ("tampered_manifest", "4.03 Forbidden: stage 1 of run 'attack': the manifest signature does not verify"),
    ("unsigned_manifest", "4.03 Forbidden: stage 1 of run 'attack' is not signed by the cluster"),
    ("forbidden_domain", "4.03 Forbidden: stage refused: stage 1 backward: operator domain(s) 'evil.ops'"),
    ("oversized", "4.13 Request Entity Too Large"),
])
def test_each_hostile_request_gets_its_documented_refusal(trained, name, text):
    assert text in trained["refusals"][name]


def test_no_credential_reaches_logs_metrics_or_traces(trained, cluster):
    secrets = []
    for path in [*cluster.workers, cluster.store.coordinator_credential, cluster.keys / "cluster.key"]:
        body = re.search(rb"-----BEGIN PRIVATE KEY-----\n(.*?)-----END", path.read_bytes(), re.S).group(1)
        secrets.append(body.replace(b"\n", b"")[:40])
        oscore = read_oscore(path.read_bytes())  # the OSCORE master secret, or the coordinator's root
        if oscore is not None:  # (cluster.key has none)
            secret = oscore.root if isinstance(oscore, OscoreRoot) else oscore.secret
            secrets += [secret[:20], secret.hex().encode()[:40]]
    files = [p for folder in (trained["out"], trained["logs"]) for p in folder.rglob("*") if p.is_file()]
    assert files
    for path in files:
        data = path.read_bytes()
        assert b"PRIVATE KEY" not in data, path
        assert not any(secret in data.replace(b"\n", b"") for secret in secrets), path




def test_ten_thousand_hostile_requests_change_nothing(trained, cluster):
    """Random paths, methods and payloads from an unenrolled peer and from an enrolled (non-coordinator)
    one, against the worker that holds stage 1: no crash, no 5.xx, parameters and step unchanged, memory bounded."""
    workers = trained["workers"]
    url, process = workers.urls[1], workers.processes[1]

    async def main() -> dict[str, int]:
        async with TensorClient(tls=cluster.coordinator) as boss:
            before = (await boss.get(url, "weights")).envelope()
            health = (await boss.get(url, "health")).envelope().meta
            rss_before = resident_bytes(process.pid)
            codes: dict[str, int] = {}
            rng = random.Random(7)
            paths = ["health", "stage", "run", "batch", "stop", "weights", "migrate", "replica", "profile",
                     "probe", "echo", "act", "grad", ".well-known/core", "nope", "stage/1/x"]
            async with TensorClient(tls=cluster.anonymous()) as anonymous, \
                    TensorClient(tls=cluster.tls(cluster.workers[3])) as insider:
                async def one(k: int) -> None:
                    client = anonymous if k % 4 == 0 else insider
                    method = rng.choice(["GET", "POST", "PUT", "DELETE", "FETCH"])
                    response = await client.request(method, url, rng.choice(paths), _hostile_payload(rng, before),
                                                    raise_for_status=False, retries=0, timeout=30)
                    codes[response.code.dotted] = codes.get(response.code.dotted, 0) + 1

                for start in range(0, FUZZ_REQUESTS, 50):
                    await asyncio.gather(*(one(k) for k in range(start, min(start + 50, FUZZ_REQUESTS))))
            after = (await boss.get(url, "weights")).envelope()
            assert (await boss.get(url, "health")).envelope().meta["step"] == health["step"]
            for name, value in before.tensors.items():
                np.testing.assert_array_equal(after.tensors[name], value, err_msg=name)
            codes["rss_growth_kib"] = (resident_bytes(process.pid) - rss_before) // 1024
            return codes

    codes = asyncio.run(main())
    assert process.poll() is None, "the worker died"
    assert sum(v for k, v in codes.items() if k[0] in "245") == FUZZ_REQUESTS, codes
    assert not any(k.startswith("5.") for k in codes), codes  # refused as bad input, never a handler failure
    assert codes.get("4.01", 0) >= FUZZ_REQUESTS // 5, codes
    assert codes["rss_growth_kib"] < 64 * 1024, codes


def _hostile_payload(rng: random.Random, weights: Envelope) -> bytes | None:
    choice = rng.randrange(5)
    if choice == 0:
        return None
    if choice == 1:
        return rng.randbytes(rng.randrange(1, 4096))
    if choice == 2:  # well-formed envelope, wrong in kind, run, shapes or meta
        kind = rng.choice(["activations", "gradients", "batch", "control", "stage", "weights", "report"])
        tensors = {rng.choice(["x", "input", "fc1.weight"]): np.zeros(rng.choice([(1,), (3, 7), (0,)]), np.float32)}
        meta = rng.choice([{}, {"command": "truncate", "last": -5}, {"entry": "{"}, {"url": "coaps+tcp://1.2.3.4:1"}])
        return encode_envelope(Envelope(kind, run_id=rng.choice(["", "run", "attack"]), step=rng.randrange(0, 9),
                                        microbatch=rng.randrange(0, 4), stage=rng.randrange(0, 4),
                                        tensors=tensors, meta=meta))
    data = bytearray(encode_envelope(weights) if choice == 3 else encode_envelope(Envelope("control")))
    for _ in range(rng.randrange(1, 8)):  # a real message with bytes flipped or cut
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data[:rng.randrange(1, len(data) + 1)]) if rng.random() < 0.5 else bytes(data)


def test_a_replan_and_a_kill_recovery_work_over_tls(cluster, tmp_path):
    """The coordinator re-plans (signed stages, migrations between workers) and recovers from a SIGKILL
    (replicas, FETCH /weights between workers) with every byte over coaps+tcp."""
    from edgert.bench.faults import run_and_kill

    save_model(build_model("cnn"), tmp_path / "cnn.onnx")
    export_plan(tmp_path / "cnn.onnx", tmp_path / "plan", ExportOptions(stages=4, training=TrainingConfig()))
    with LocalCluster(4, names=["w0", "w1", "w2", "w3"], credentials=cluster.workers) as workers:
        config = TrainConfig(plan_dir=tmp_path / "plan", workers=tuple(workers.urls), out_dir=tmp_path / "run",
                             steps=30, epochs=10, listen="coaps+tcp://127.0.0.1:0", keys=cluster.keys, progress=False,
                             replicate_every=5, central_every=5, replan_at=((8, (1, 2, 4)),))
        outcome = run_and_kill(lambda: train(config), workers, tmp_path / "run", [2], lambda health, step: step >= 15,
                               tls=cluster.coordinator)
    summary = outcome.result
    assert summary.steps == 30 and summary.replans >= 1 and summary.recoveries == 1
    recovery = [m for m in read_metrics(tmp_path / "run") if m.get("event") == "recovery"][0]
    assert "w2" not in recovery["workers"] and recovery["steps_lost"] <= 5
