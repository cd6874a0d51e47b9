"""Bodies in pieces over real CoAP-over-TCP sockets: whole and exact, into memory or a file, and every bad piece
refused with one line and a 4.xx while the server keeps its previous state and goes on serving."""

import asyncio
import hashlib

import numpy as np
import pytest

from edgert.transport import Envelope, TensorClient, TensorServer, encode_envelope
from edgert.transport.limits import Limits, MiB
from edgert.transport.pieces import (
    FileSink,
    MemorySink,
    Outgoing,
    piece_envelope,
    piece_request,
)
from edgert.transport.transfers import PieceOptions

PIECE = 1 * MiB


def state(seed: int = 0, tensors: int = 5, floats: int = 1_000_003) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal(floats).astype(np.float32) for i in range(tensors)}


class Holder:
    """A server resource holding one state: PUT replaces it (a body in pieces admitted up to ``bound``), GET
    answers it (in pieces when large)."""

    def __init__(self, bound: int, limits: Limits = Limits()):
        self.kept = Envelope("weights", step=1, tensors=state(1))
        self.bound = bound
        self.server = TensorServer("coap+tcp://127.0.0.1:0", limits=limits)
        self.server.add_resource("weights", get=self.get, put=self.put, rt="test.weights", kinds=("weights",),
                                 pieces=self.admit, piece_answers=True)

    def admit(self, request, piece):
        from edgert.transport import TooLarge

        if piece.size > self.bound:
            raise TooLarge(f"a state of {piece.size} bytes; this holder takes at most {self.bound}", size1=self.bound)
        return MemorySink(piece.size)

    async def get(self, request):
        return self.kept

    async def put(self, request):
        self.kept = request.envelope


def run(coroutine):
    return asyncio.run(coroutine)


async def serving(holder: Holder):
    await holder.server.start()
    return holder.server.urls[0]


def test_a_state_far_over_a_piece_goes_up_and_comes_back_exact():
    async def main():
        holder = Holder(bound=1 << 30)
        url = await serving(holder)
        sent = Envelope("weights", step=7, stage=2, tensors=state(2))
        async with TensorClient() as client:
            answer = await client.request("PUT", url, "weights", sent,
                                          pieces=PieceOptions(max_body=0, piece_bytes=PIECE))
            fetched = await client.request("GET", url, "weights", pieces=PieceOptions(max_body=1 << 30))
        await holder.server.shutdown()
        return answer, holder.kept, fetched.envelope(), holder.server.transfers

    answer, kept, fetched, transfers = run(main())
    assert answer.code.dotted == "2.04"
    for got in (kept, fetched):
        assert (got.step, got.stage) == (7, 2)
        assert all(np.array_equal(got.tensors[name], value) for name, value in state(2).items())
    assert transfers.receiving == transfers.answering == 0  # nothing held once done


def test_a_state_fetched_into_a_file_is_the_exact_encoding_and_no_partial_file_is_left(tmp_path):
    async def main():
        holder = Holder(bound=1 << 30)
        url = await serving(holder)
        async with TensorClient() as client:
            response = await client.request(
                "GET", url, "weights",
                pieces=PieceOptions(max_body=1 << 30, sink=lambda size: FileSink(tmp_path / "stage0.cbor")))
        await holder.server.shutdown()
        return response, holder.kept

    response, kept = run(main())
    assert response.stored == tmp_path / "stage0.cbor"
    assert (tmp_path / "stage0.cbor").read_bytes() == encode_envelope(kept)
    assert [p.name for p in tmp_path.iterdir()] == ["stage0.cbor"]


def test_a_response_larger_than_the_request_takes_is_refused_before_it_is_fetched():
    async def main():
        holder = Holder(bound=1 << 30)
        url = await serving(holder)
        async with TensorClient() as client:
            with pytest.raises(Exception) as refused:
                await client.request("GET", url, "weights", pieces=PieceOptions(max_body=10 * MiB))
        await holder.server.shutdown()
        return refused.value

    error = run(main())
    assert type(error).__name__ == "TooLarge" and "this request takes at most 10485760" in str(error)


def pieces_of(body: Envelope, transfer: int = 11, piece_bytes: int = PIECE) -> list[Envelope]:
    """``body``'s pieces as a sender makes them."""
    from edgert.transport.envelope import encode_envelope_parts

    outgoing = Outgoing(encode_envelope_parts(body), piece_bytes)
    return [piece_envelope(body, transfer, offset, outgoing.size, data.copy(), digest)
            for offset, data, digest in outgoing.pieces()]


async def send_all(client, url, pieces, path="weights"):
    return [await client.request("PUT", url, path, piece, raise_for_status=False, retries=0) for piece in pieces]


def bad_transfers() -> dict[str, tuple[list[Envelope], str, str]]:
    """name: (the pieces sent, the code of the answer to the last, a phrase of its diagnostic)."""
    body = Envelope("weights", step=9, tensors=state(3, tensors=2))
    good = pieces_of(body)
    last = good[-1]
    wrong_digest = Envelope("piece", step=9, tensors=last.tensors,
                            meta={**last.meta, "digest": hashlib.sha256(b"other").digest()})
    past_end = Envelope("piece", step=9, tensors={"data": np.zeros(PIECE, np.uint8)},
                        meta={**good[1].meta, "offset": good[0].meta["size"] - 10})
    size_changed = Envelope("piece", step=9, tensors=good[1].tensors, meta={**good[1].meta, "size": 10**9})
    return {
        "out of order": ([good[0], good[2]], "4.08", "pieces go in order"),
        "wrong digest": (good[:-1] + [wrong_digest], "4.00", "SHA-256 does not match"),
        "a piece past the declared size": ([good[0], past_end], "4.13", "passes the body's declared size"),
        "a piece that changes the size": ([good[0], size_changed], "4.00", "the transfer's first piece said"),
        "a continuation of no transfer": (good[1:2], "4.08", "send the body again from its first piece"),
        "a digest on a piece before the last": (
            [Envelope("piece", step=9, tensors=good[0].tensors,
                      meta={**good[0].meta, "digest": hashlib.sha256().digest()})], "4.00", "is not the last"),
        "a declared size over the holder's bound": (
            [Envelope("piece", step=9, tensors=good[0].tensors, meta={**good[0].meta, "size": 1 << 40})],
            "4.13", "this holder takes at most"),
        "a piece with a float tensor": (
            [Envelope("piece", step=9, tensors={"data": np.zeros(4, np.float32)}, meta=good[0].meta)], "4.00",
            "exactly one tensor, 'data', of uint8"),
    }


@pytest.mark.parametrize("name", list(bad_transfers()))
def test_a_bad_piece_gets_one_line_and_a_4xx_and_the_holder_keeps_its_state_and_serves_on(name):
    pieces, code, phrase = bad_transfers()[name]

    async def main():
        holder = Holder(bound=1 << 30)
        url = await serving(holder)
        before = holder.kept
        async with TensorClient() as client:
            answers = await send_all(client, url, pieces)
            kept = holder.kept
            held = holder.server.transfers.receiving
            after = await client.request("PUT", url, "weights", Envelope("weights", step=10, tensors=state(4, 2)),
                                         pieces=PieceOptions(max_body=0, piece_bytes=PIECE))
        await holder.server.shutdown()
        return answers, before, kept, held, after, holder.kept

    answers, before, kept, held, after, last = run(main())
    refusal = answers[-1]
    assert refusal.code.dotted == code, (refusal.code.dotted, refusal.text)
    assert phrase in refusal.text and "\n" not in refusal.text, refusal.text
    assert all(a.code.dotted == "2.31" for a in answers[:-1])
    assert kept is before and held == 0  # nothing taken, nothing held for the refused transfer
    assert after.code.dotted == "2.04" and last.step == 10  # and the holder goes on


def test_garbage_cbor_in_a_piece_is_a_400_and_changes_nothing():
    async def main():
        holder = Holder(bound=1 << 30)
        url = await serving(holder)
        before = holder.kept
        async with TensorClient() as client:
            answer = await client.request("PUT", url, "weights", b"\xa8\x61v\x01\xff\xff garbage", content_format=60,
                                          raise_for_status=False)
        await holder.server.shutdown()
        return answer, before is holder.kept, holder.server.transfers.receiving

    answer, unchanged, held = run(main())
    assert answer.code.dotted == "4.00" and unchanged and held == 0


def test_an_abandoned_transfer_is_dropped_after_the_frame_timeout_and_its_rest_is_refused():
    async def main():
        holder = Holder(bound=1 << 30, limits=Limits(frame_timeout=0.3))
        url = await serving(holder)
        pieces = pieces_of(Envelope("weights", tensors=state(5, tensors=2)))
        async with TensorClient() as client:
            first = await send_all(client, url, pieces[:2])
            held = holder.server.transfers.receiving
            await asyncio.sleep(0.6)
            dropped = holder.server.transfers.receiving
            rest = await send_all(client, url, pieces[2:3])
        await holder.server.shutdown()
        return first, held, dropped, rest

    first, held, dropped, rest = run(main())
    assert [a.code.dotted for a in first] == ["2.31", "2.31"] and held == 1 and dropped == 0
    assert rest[0].code.dotted == "4.08" and "dropped after 0.3 s without a piece" in rest[0].text


def test_a_repeated_piece_is_taken_once_and_too_many_transfers_at_once_are_told_to_wait():
    async def main():
        holder = Holder(bound=1 << 30, limits=Limits(max_transfers=2))
        url = await serving(holder)
        body = Envelope("weights", step=3, tensors=state(6, tensors=2))
        pieces = pieces_of(body)
        async with TensorClient() as client:
            repeated = await send_all(client, url, [pieces[0], pieces[1], pieces[1]] + pieces[2:])
            opened = [await send_all(client, url, pieces_of(body, transfer=t)[:1]) for t in (21, 22, 23)]
        await holder.server.shutdown()
        return repeated, opened, holder.kept

    repeated, opened, kept = run(main())
    assert [a.code.dotted for a in repeated[:-1]] == ["2.31"] * (len(repeated) - 1)
    assert repeated[-1].code.dotted == "2.04" and kept.step == 3
    assert all(np.array_equal(kept.tensors[n], v) for n, v in state(6, tensors=2).items())
    assert [o[0].code.dotted for o in opened] == ["2.31", "2.31", "5.03"]
    assert "busy" in opened[2][0].text


def test_a_piece_of_a_transfer_answered_to_another_peer_is_not_handed_out():
    async def main():
        holder = Holder(bound=1 << 30)
        url = await serving(holder)
        async with TensorClient() as client:
            first = await client.request("GET", url, "weights")  # no pieces option: the first piece as it is
            transfer = first.envelope().meta["transfer"]
            # the transfer now belongs to another peer
            held = list(holder.server.transfers._outgoing.values())
            holder.server.transfers._outgoing = {("elsewhere:1", transfer): held[0]}
            stolen = await client.request("FETCH", url, "piece", piece_request(transfer, PIECE * 8),
                                          raise_for_status=False)
        await holder.server.shutdown()
        return first, stolen

    first, stolen = run(main())
    assert first.envelope().kind == "piece"
    assert stolen.code.dotted == "4.08" and "no transfer" in stolen.text


def test_a_resource_that_takes_no_pieces_refuses_them():
    async def main():
        server = TensorServer("coap+tcp://127.0.0.1:0")
        server.add_resource("plain", put=lambda request: None, rt="test.plain", kinds=("weights",))
        await server.start()
        async with TensorClient() as client:
            answer = await client.request("PUT", server.urls[0], "plain",
                                          pieces_of(Envelope("weights", tensors=state(7, 2)))[0],
                                          raise_for_status=False)
        await server.shutdown()
        return answer

    answer = run(main())
    assert answer.code.dotted == "4.00" and "takes no body in pieces" in answer.text
