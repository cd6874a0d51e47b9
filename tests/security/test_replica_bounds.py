"""``PUT /replica`` keeps only copies a worker is meant to hold, under the sender's proven name, within a budget.

A worker at stage k of n keeps copies of the ``replicas`` stages before it in the ring, taken
after a step its run commands announced; the origin is who the transport authenticated (the
credential's name over TLS, the address on plaintext), never ``meta.origin``; all copies
from peers share one byte budget. Anything else is a 4.xx and allocates nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from edgert.coordinator.localcluster import LocalCluster
from edgert.errors import ReplicaStoreFull
from edgert.manifest import load_manifest
from edgert.protocol import REPLICA, RUN, STAGE, Peers, Segment, StageAssignment
from edgert.replica import SELF_ORIGIN, CopyStore, holdings_from_meta
from edgert.run_settings import RunSettings
from edgert.security.admission import StageSigning
from edgert.transport import ClientConfig, Envelope, SyncClient
from edgert.transport.limits import MiB
from edgert.weights import StageState
from tests.resident_memory import resident_bytes

pytestmark = pytest.mark.timeout(300)

RUN_ID, NOWHERE = "replicas", "coap+tcp://127.0.0.1:9"


def stage1(plan: Path, coordinator: str = NOWHERE) -> Envelope:
    """Stage 1 of 3 with one replica: it keeps copies of stage 0; it waits for activations all along."""
    manifest = load_manifest(plan)
    entry = manifest.stages[1]
    files = {a.role: (plan / a.path).read_bytes() for a in entry.artifacts}
    assignment = StageAssignment(
        run_id=RUN_ID, entry=entry, stages=3, peers=Peers(NOWHERE, NOWHERE, coordinator),
        settings=RunSettings(manifest.training, wait_timeout=3600.0, replicate_every=5, central_every=0),
        replica_targets=(NOWHERE,))
    return assignment.to_envelope(files)


def copy(stage: int, step: int, size: int, origin: str) -> Envelope:
    state = StageState(parameters={"w": np.ones(size // 4, np.float32)}, step=step, stage=stage)
    envelope = state.to_envelope(RUN_ID)
    return Envelope("weights", run_id=RUN_ID, step=step, stage=stage, tensors=envelope.tensors,
                    meta={"origin": origin})




def holdings(client, url):
    return holdings_from_meta(client.get(url, REPLICA).envelope().meta["holdings"])


def test_forty_8_mib_copies_of_strangers_stages_are_refused_and_take_no_memory(mlp_plan3):
    with LocalCluster(1) as cluster, SyncClient.start(ClientConfig(timeout=60.0, retries=0)) as client:
        url, pid = cluster.urls[0], cluster.processes[0].pid
        client.request("PUT", url, STAGE, stage1(mlp_plan3))
        client.send(url, RUN, Segment("gpipe", 3, 0, 100, 8, 2).to_envelope(RUN_ID))
        warm = client.request("PUT", url, REPLICA, copy(99, 3, 8 * MiB, "warm-up"), raise_for_status=False)
        assert warm.code.dotted == "4.03"
        time.sleep(0.5)
        before = resident_bytes(pid)
        answers = [client.request("PUT", url, REPLICA, copy(100 + i, 3, 8 * MiB, f"evil-{i}"), raise_for_status=False)
                   for i in range(40)]
        time.sleep(0.5)
        grown = resident_bytes(pid) - before
        assert {a.code.dotted for a in answers} == {"4.03"}
        assert answers[0].text == "stage 1 keeps copies of stage(s) [0] of 3, not of stage 100"
        assert grown < 16 * MiB, f"worker RSS grew by {grown / MiB:.1f} MiB"
        assert holdings(client, url) == []

        # a copy after a step no run command announced
        late = client.request("PUT", url, REPLICA, copy(0, 500, 1024, "x"), raise_for_status=False)
        assert late.code.dotted == "4.00" and "after step 500, which no run command" in late.text
        # the stage it does keep: the newest two versions, the origin as the transport saw it
        for step in (4, 9, 14):
            client.request("PUT", url, REPLICA, copy(0, step, 1024, "evil"))
        kept = holdings(client, url)
        assert [(h.step, h.stage) for h in kept] == [(9, 0), (14, 0)]
        assert {h.origin for h in kept} != {"evil"} and all(h.origin.startswith("127.0.0.1") for h in kept)
        assert client.get(url, "health").ok


def test_over_tls_the_origin_is_the_senders_credential(cluster, mlp_plan3):
    signing = StageSigning(cluster.store.sign, cluster.store.crl_pem)
    with LocalCluster(1, names=["w1"], credentials=[cluster.workers[1]]) as workers:
        url = workers.urls[0]
        with SyncClient.start(ClientConfig(timeout=60.0, retries=0), tls=cluster.coordinator) as boss:
            boss.request("PUT", url, STAGE, signing.apply(stage1(mlp_plan3, coordinator="coaps+tcp://127.0.0.1:9")))
            boss.send(url, RUN, Segment("gpipe", 3, 0, 100, 8, 2).to_envelope(RUN_ID))
            with SyncClient.start(ClientConfig(timeout=60.0, retries=0), tls=cluster.tls(cluster.workers[0])) as w0:
                w0.request("PUT", url, REPLICA, copy(0, 4, 1024, "the-coordinator"))
            assert [(h.step, h.origin) for h in holdings(boss, url)] == [(4, "w0")]


def test_copies_from_peers_share_one_budget_and_a_refusal_changes_nothing():
    store = CopyStore(keep_versions=2, max_peer_bytes=3000)
    store.put(StageState(parameters={"w": np.ones(250, np.float32)}, step=1, stage=0), "w0")  # 1000 bytes
    store.put(StageState(parameters={"w": np.ones(250, np.float32)}, step=1, stage=2), "w2")
    with pytest.raises(ReplicaStoreFull, match="copies from peers would take 3200 bytes here; the limit is 3000"):
        store.put(StageState(parameters={"w": np.ones(300, np.float32)}, step=1, stage=3), "w3")
    assert [(h.step, h.stage) for h in store.holdings()] == [(1, 0), (1, 2)] and store.room() == 1000
    # a newer version replaces the oldest beyond keep_versions, so it fits where an extra one would not
    store.put(StageState(parameters={"w": np.ones(250, np.float32)}, step=2, stage=0), "w0")
    store.put(StageState(parameters={"w": np.ones(250, np.float32)}, step=3, stage=0), "w0")
    assert [(h.step, h.stage) for h in store.holdings()] == [(1, 2), (2, 0), (3, 0)]
    # the worker's own snapshots are not counted against peers
    store.put(StageState(parameters={"w": np.ones(10_000, np.float32)}, step=3, stage=1), SELF_ORIGIN)
    assert store.room() == 0
