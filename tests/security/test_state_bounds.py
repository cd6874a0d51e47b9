"""A worker takes a state in pieces only up to what its stage holds: a peer cannot make it buffer more than the
stage it is assigned (its own state for ``PUT /weights``, its room for copies for ``PUT /replica``), and a bad
or abandoned transfer keeps nothing and leaves what it held before (docs/SECURITY.md, "Bounded resources")."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from edgert.coordinator.localcluster import LocalCluster
from edgert.protocol import REPLICA, RUN, STAGE, WEIGHTS, Segment
from edgert.transport import ClientConfig, Envelope, PieceOptions, SyncClient
from edgert.transport.envelope import encode_envelope_parts
from edgert.transport.limits import KiB, MiB
from edgert.transport.pieces import Outgoing, piece_envelope
from edgert.weights import StageState
from tests.resident_memory import resident_bytes
from tests.security.test_replica_bounds import RUN_ID, copy, holdings, stage1

pytestmark = pytest.mark.timeout(300)
SMALL_PIECES = PieceOptions(max_body=0, piece_bytes=16 * KiB)


def pieces_of(body: Envelope, transfer: int, piece_bytes: int = 16 * KiB) -> list[Envelope]:
    outgoing = Outgoing(encode_envelope_parts(body), piece_bytes)
    return [piece_envelope(body, transfer, offset, outgoing.size, data.copy(), digest)
            for offset, data, digest in outgoing.pieces()]


def declaring(body: Envelope, size: int, transfer: int) -> Envelope:
    """The first piece of ``body`` with a made-up total size."""
    first = pieces_of(body, transfer)[0]
    return Envelope("piece", run_id=first.run_id, step=first.step, stage=first.stage, tensors=first.tensors,
                    meta={**first.meta, "size": size})


def test_a_worker_takes_states_in_pieces_only_up_to_its_stage_and_keeps_nothing_of_bad_ones(mlp_plan3):
    with LocalCluster(1) as cluster, SyncClient.start(ClientConfig(timeout=60.0, retries=0)) as client:
        url, pid = cluster.urls[0], cluster.processes[0].pid
        client.request("PUT", url, STAGE, stage1(mlp_plan3), pieces=SMALL_PIECES)  # the assignment in pieces too
        client.send(url, RUN, Segment("gpipe", 3, 0, 100, 8, 2).to_envelope(RUN_ID))
        own = client.request("GET", url, WEIGHTS, pieces=PieceOptions(max_body=1 << 30)).envelope()
        time.sleep(0.3)
        before = resident_bytes(pid)

        # its own state: a peer (or the coordinator) declaring 4 GiB for PUT /weights is refused up front
        huge = client.request("PUT", url, WEIGHTS, declaring(own, 4 << 30, 1), raise_for_status=False)
        assert huge.code.dotted == "4.13" and "for stage 1, whose whole state takes at most" in huge.text, huge.text

        # copies: a good one in pieces is kept; one declaring more than the room is refused from its first piece
        kept = client.request("PUT", url, REPLICA, copy(0, 4, 200 * KiB, "x"), pieces=SMALL_PIECES)
        assert kept.code.dotted == "2.04" and [(h.step, h.stage) for h in holdings(client, url)] == [(4, 0)]
        over = client.request("PUT", url, REPLICA, declaring(copy(0, 9, 64 * KiB, "x"), 8 << 30, 2),
                              raise_for_status=False)
        assert over.code.dotted == "4.13" and "does not fit: copies from peers may take" in over.text, over.text
        stranger = client.request("PUT", url, REPLICA, pieces_of(copy(7, 9, 64 * KiB, "x"), 3)[0],
                                  raise_for_status=False)
        assert stranger.code.dotted == "4.03"

        # a copy whose last piece carries a wrong digest, and one abandoned half way: nothing of either is kept
        pieces = pieces_of(copy(0, 9, 100 * KiB, "x"), 4)
        last = pieces[-1]
        forged = Envelope("piece", run_id=last.run_id, step=last.step, stage=last.stage, tensors=last.tensors,
                          meta={**last.meta, "digest": hashlib.sha256(b"forged").digest()})
        answers = [client.request("PUT", url, REPLICA, p, raise_for_status=False) for p in pieces[:-1] + [forged]]
        assert answers[-1].code.dotted == "4.00" and "SHA-256 does not match" in answers[-1].text
        half = [client.request("PUT", url, REPLICA, p, raise_for_status=False)
                for p in pieces_of(copy(0, 14, 100 * KiB, "x"), 5)[:3]]
        assert [a.code.dotted for a in half] == ["2.31"] * 3
        assert [(h.step, h.stage) for h in holdings(client, url)] == [(4, 0)]  # the copy held before stays

        garbage = client.request("PUT", url, REPLICA, b"\x82\x01", content_format=60, raise_for_status=False)
        assert garbage.code.dotted == "4.00"
        time.sleep(0.3)
        grown = resident_bytes(pid) - before
        assert grown < 16 * MiB, f"worker RSS grew by {grown / MiB:.1f} MiB"
        after = client.request("GET", url, WEIGHTS, pieces=PieceOptions(max_body=1 << 30)).envelope()
        assert all(np.array_equal(after.tensors[n], own.tensors[n]) for n in own.tensors)  # its state untouched
        state = StageState.from_envelope(after)
        assert state.parameters and client.get(url, "health").ok
