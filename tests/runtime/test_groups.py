"""Groups in the contract: shares become whole rows the same way everywhere, a member knows which row pieces
it takes from and gives to each neighbouring member, and the stage assignment carries the groups on the wire."""

from __future__ import annotations

import dataclasses

import pytest

from edgert.errors import EdgertError, ProtocolError
from edgert.groups import StageGroup, StageRouting, overlaps, row_ranges, share_rows
from edgert.protocol import StageAssignment
from edgert.transport.envelope import decode_envelope, encode_envelope
from tests.runtime.test_stage_assignment import ASSIGNMENT

A, B, C, D = (f"coap+tcp://10.0.0.{k}:5683" for k in range(1, 5))


@pytest.mark.parametrize(("shares", "rows", "counts"), [
    ((0.7, 0.3), 16, [11, 5]),  # 11.2 / 4.8: the larger remainder (0.8) gets the spare row
    ((0.5, 0.5), 17, [9, 8]),  # a tie goes to the lower index
    ((1, 1, 1), 10, [4, 3, 3]),
    ((0.98, 0.01, 0.01), 3, [1, 1, 1]),  # every member at least one row
    ((0.9, 0.05, 0.05), 10, [8, 1, 1]),  # 9 / 0.5 / 0.5: the minimum rows are taken from the largest share
    ((2.0, 1.0), 3, [2, 1]),  # shares need not sum to 1
])
def test_shares_become_whole_rows_by_largest_remainder(shares, rows, counts):
    assert share_rows(shares, rows) == counts
    assert sum(counts) == rows


def test_row_ranges_tile_the_micro_batch_and_too_few_rows_are_refused():
    assert row_ranges((0.7, 0.3), 16) == [(0, 11), (11, 16)]
    with pytest.raises(EdgertError, match=r"a micro-batch of 2 sample\(s\) cannot be split across a group of 3"):
        share_rows((1, 1, 1), 2)


def test_pieces_are_the_intersections_of_neighbouring_row_ranges():
    assert overlaps((11, 16), [(0, 6), (6, 16)]) == [(1, 11, 16)]
    assert overlaps((0, 11), [(0, 6), (6, 16)]) == [(0, 0, 6), (1, 6, 11)]
    middle = StageGroup((A, B), (0.7, 0.3))
    last = StageGroup((C, D), (0.4, 0.6))
    first_member = StageRouting(middle, 0, StageGroup((D,), (1.0,)), last)
    assert first_member.own(16) == (0, 11)
    assert first_member.pieces("next", 16) == [(C, 0, 6), (D, 6, 11)]  # rows 0-5 to C, 6-10 to D
    assert first_member.pieces("previous", 16) == [(D, 0, 11)]
    assert StageRouting(last, 1, middle, None).pieces("previous", 16) == [(A, 6, 11), (B, 11, 16)]
    assert first_member.split("next") and first_member.split("previous")  # a group on either side splits
    alone = StageRouting(None, 0, StageGroup((A,), (1.0,)), None)
    assert not alone.split("previous") and not alone.grouped and alone.own(16) == (0, 16)


def test_the_assignment_carries_its_group_and_the_neighbouring_groups_on_the_wire():
    previous = StageGroup(("coap+tcp://10.0.0.1:5683", B), (0.25, 0.75), ("w0", "w0b"))
    mine = StageGroup((C, D), (0.5, 0.5))
    assignment = dataclasses.replace(ASSIGNMENT, peers=dataclasses.replace(ASSIGNMENT.peers, previous_group=previous),
                                     group=mine, member=1)
    envelope = decode_envelope(encode_envelope(assignment.to_envelope({})))
    assert envelope.meta["group"] == {"members": [C, D], "shares": [0.5, 0.5], "names": []}  # maps, not JSON text
    received, _ = StageAssignment.from_envelope(envelope)
    assert received == assignment and not received.holder
    assert received.routing.pieces("previous", 8) == [(B, 4, 8)]
    assert ASSIGNMENT.routing.own(8) == (0, 8) and ASSIGNMENT.holder  # no group: the whole micro-batch


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: m.update(member=2, group={"members": [C, D], "shares": [0.5, 0.5]}), r"member 2 of a group of 2"),
    (lambda m: m.update(group={"members": [C, D], "shares": [1.0]}), r"group of 2 member\(s\) has 1 share\(s\)"),
    (lambda m: m.update(group={"members": [C, D], "shares": [1.0, -1.0]}), r"group.shares must be positive"),
    (lambda m: m.update(group={"members": [C, C], "shares": [1.0, 1.0]}), r"group.members must be one or more"),
    (lambda m: m["peers"].update(next_group={"members": [D, C], "shares": [1.0, 1.0]}),
     r"peers.next 'coap\+tcp://10.0.0.3:5683' must be peers.next_group's first member"),
])
def test_a_malformed_group_is_refused_naming_it(change, message):
    envelope = decode_envelope(encode_envelope(ASSIGNMENT.to_envelope({})))
    change(envelope.meta)
    with pytest.raises(ProtocolError, match=message):
        StageAssignment.from_envelope(envelope)
