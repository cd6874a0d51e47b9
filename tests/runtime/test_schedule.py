"""Schedules are pure functions: compared with literal tables, and simulated to prove they run."""

import pytest

from edgert.errors import EdgertError
from edgert.schedule import (
    SCHEDULES,
    STEP,
    Action,
    Computation,
    Schedule,
    max_in_flight,
    schedule_table,
    simulate,
    stage_actions,
    steps_ahead,
)


def test_gpipe_table():
    assert schedule_table("gpipe", 2, 3) == [
        ["F0", "F1", "F2", "B0", "B1", "B2", "S"],
        ["F0", "F1", "F2", "B0", "B1", "B2", "S"],
    ]


def test_1f1b_table():
    assert schedule_table("1f1b", 3, 5) == [
        ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "B2", "B3", "B4", "S"],  # warm-up 3
        ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "B3", "B4", "S"],  # warm-up 2
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "S"],  # last: forward folded
    ]


def test_1f1b_with_fewer_microbatches_than_stages():
    assert schedule_table("1f1b", 4, 2) == [
        ["F0", "F1", "B0", "B1", "S"],  # warm-up min(4, 2) = 2
        ["F0", "F1", "B0", "B1", "S"],  # warm-up min(3, 2) = 2
        ["F0", "F1", "B0", "B1", "S"],  # warm-up 2
        ["F0", "B0", "F1", "B1", "S"],  # last stage: warm-up 0
    ]


def test_async_table_steps_after_every_backward():
    assert schedule_table("async", 3, 4) == [
        ["F0", "F1", "F2", "B0", "S", "F3", "B1", "S", "B2", "S", "B3", "S"],
        ["F0", "F1", "B0", "S", "F2", "B1", "S", "F3", "B2", "S", "B3", "S"],
        ["F0", "B0", "S", "F1", "B1", "S", "F2", "B2", "S", "F3", "B3", "S"],
    ]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "async"])
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 5), (4, 8), (5, 3)])
def test_every_microbatch_forwarded_and_backwarded_once_and_no_deadlock(kind, stages, microbatches):
    for stage in range(stages):
        actions = [str(a) for a in stage_actions(kind, stage, stages, microbatches)]
        assert sorted(a for a in actions if a[0] == "F") == sorted(f"F{m}" for m in range(microbatches))
        assert sorted(a for a in actions if a[0] == "B") == sorted(f"B{m}" for m in range(microbatches))
    assert simulate(kind, [1.0] * stages, [2.0] * stages, microbatches) > 0
    assert simulate(kind, [1.0] * stages, [2.0] * stages, microbatches, side_by_side=[True] * stages) > 0


def test_forwards_side_by_side_shorten_1f1b_to_the_backwards_bound():
    # two stages, 8 micro-batches, F = 1 and B = 3 (the backward recomputes the forward): one after the
    # other the first stage needs 4 a micro-batch; beside each other max(F, B) = 3, the last stage's own
    forward, backward = [1.0, 1.0], [3.0, 3.0]
    one_after = simulate("1f1b", forward, backward, 8)
    beside = simulate("1f1b", forward, backward, 8, side_by_side=[True, True])
    assert one_after == 33.0 and beside == 28.0
    assert beside >= 8 * 3.0 + 1.0 + 3.0  # every backward of a stage, after the pipeline's fill and drain
    # the last stage has no forward to move; GPipe runs every forward before any backward; async keeps one thread
    assert simulate("1f1b", forward, backward, 8, side_by_side=[False, True]) == one_after
    assert simulate("gpipe", forward, backward, 8, side_by_side=[True, True]) == simulate("gpipe", forward, backward, 8)
    assert simulate("async", forward, backward, 8, side_by_side=[True, True]) == simulate("async", forward, backward, 8)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_steps_back_to_back_take_one_window_each_without_a_weight_call(kind):
    forward, backward, links = [1.0, 2.0, 1.0], [2.0, 3.0, 2.0], [0.1, 0.2]
    one = simulate(kind, forward, backward, 4, links)
    assert simulate(kind, forward, backward, 4, links, steps=3) == pytest.approx(3 * one)
    beside = [True, True, False]
    assert simulate(kind, forward, backward, 4, links, beside, steps=2) == pytest.approx(
        2 * simulate(kind, forward, backward, 4, links, beside))


def test_a_later_stages_weight_call_overlaps_the_next_steps_first_forwards():
    # two stages, F = 1, B = 2, 4 micro-batches: one window takes 12. The last stage's last backward ends at 9;
    # the next step's first forward reaches it at 13 (stage 0's last backward, its step, its forward): a weight
    # call of up to 4 before the step costs the interval between steps nothing, a longer one its excess
    forward, backward = [1.0, 1.0], [2.0, 2.0]

    def interval(weights: float) -> float:
        return (simulate("1f1b", forward, backward, 4, [0.0], weights_ms=[0.0, weights], steps=2)
                - simulate("1f1b", forward, backward, 4, [0.0], weights_ms=[0.0, weights]))

    assert simulate("1f1b", forward, backward, 4, [0.0]) == 12.0
    assert simulate("1f1b", forward, backward, 4, [0.0], weights_ms=[0.0, 5.0]) == 14.0  # one window: its makespan
    assert [interval(w) for w in (0.0, 4.0, 5.0, 20.0)] == pytest.approx([12.0, 12.0, 13.0, 28.0])


def test_1f1b_bounds_memory_where_gpipe_does_not():
    gpipe = [max_in_flight(stage_actions("gpipe", s, 4, 8)) for s in range(4)]
    f1b = [max_in_flight(stage_actions("1f1b", s, 4, 8)) for s in range(4)]
    assert gpipe == [8, 8, 8, 8]
    assert f1b == [5, 4, 3, 1]  # stages - stage + 1, the last stage 1
    asynchronous = [max_in_flight(stage_actions("async", s, 4, 8)) for s in range(4)]
    assert asynchronous == [4, 3, 2, 1]  # PipeDream / FTPipeHD: stage s holds at most stages - s


def test_simulated_bubble_matches_the_textbook_formula():
    # equal stages, forward folded into the last stage's backward: 1F1B makespan is
    # (M + S - 1) slots of (F + B) minus what the last stage saves.
    stages, microbatches = 4, 8
    makespan = simulate("1f1b", [1.0] * stages, [2.0] * stages, microbatches)
    assert makespan == pytest.approx((microbatches + stages - 1) * 3.0, rel=0.15)


def test_extra_warmup_forward_hides_link_latency():
    forward, backward, links = [5.0] * 4, [12.0, 12.0, 12.0, 15.0], [1.0] * 3
    assert simulate("1f1b", forward, backward, 8, links) < simulate("gpipe", forward, backward, 8, links)
    assert simulate("1f1b", forward, backward, 8, links) <= 187.0  # textbook warm-up: 199 (see module doc)
    assert simulate("gpipe", [1.0], [2.0], 4) == 8.0  # one stage: forwards folded, 4 backwards


def test_bad_arguments():
    with pytest.raises(EdgertError, match="unknown schedule 'zigzag'"):
        stage_actions("zigzag", 0, 2, 2)
    with pytest.raises(EdgertError, match="stage 3 is not in 0..1"):
        stage_actions("1f1b", 3, 2, 2)
    with pytest.raises(EdgertError, match="micro-batches must be at least 1"):
        stage_actions("gpipe", 0, 2, 0)


def test_the_coordinator_feeds_no_more_steps_than_the_inboxes_hold():
    # (schedule, stages, micro-batches) -> steps ahead, for a lookahead of 8 and 256-message inboxes
    ahead = {(kind, stages, m): steps_ahead(kind, stages, m, lookahead=8, capacity=256)
             for kind in ("gpipe", "1f1b") for stages in (1, 4) for m in (1, 8, 16, 32, 64)}
    assert ahead == {
        ("gpipe", 1, 1): 8, ("gpipe", 1, 8): 8, ("gpipe", 1, 16): 8, ("gpipe", 1, 32): 4, ("gpipe", 1, 64): 2,
        ("gpipe", 4, 1): 8, ("gpipe", 4, 8): 8, ("gpipe", 4, 16): 8, ("gpipe", 4, 32): 7, ("gpipe", 4, 64): 3,
        ("1f1b", 1, 1): 8, ("1f1b", 1, 8): 8, ("1f1b", 1, 16): 8, ("1f1b", 1, 32): 4, ("1f1b", 1, 64): 2,
        ("1f1b", 4, 1): 8, ("1f1b", 4, 8): 8, ("1f1b", 4, 16): 8, ("1f1b", 4, 32): 7, ("1f1b", 4, 64): 3,
    }
    assert steps_ahead("async", 4, 64, lookahead=8, capacity=256) == 12  # one micro-batch a step, never drained
    assert steps_ahead("1f1b", 1, 64, lookahead=8, capacity=64) == 1  # at least one step, whatever the inbox


def test_schedules_keep_their_names_on_the_wire():
    assert SCHEDULES == ("gpipe", "1f1b", "async")
    assert [Schedule.named(name) for name in SCHEDULES] == [Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.ASYNC]
    assert Schedule.ONE_F_ONE_B == "1f1b" and f"{Schedule.ASYNC}" == "async" and str(Schedule.GPIPE) == "gpipe"
    with pytest.raises(EdgertError, match="unknown schedule 'pipedream'; choose one of gpipe, 1f1b, async"):
        Schedule.named("pipedream")


def test_actions_print_as_torch_pipelining_writes_them_and_parse_back():
    table = {
        "F0": Action(Computation.FORWARD, 0),
        "B13": Action(Computation.BACKWARD, 13),
        "S": STEP,
        "2F0": Action(Computation.FORWARD, 0, stage=2),
        "10B3": Action(Computation.BACKWARD, 3, stage=10),
        "1S": STEP.on(1),
    }
    assert {str(action): action for action in table.values()} == table
    assert {text: Action.parse(text) for text in table} == table
    for kind in SCHEDULES:
        for stage, actions in enumerate(schedule_table(kind, 3, 4)):
            assert [str(Action.parse(a).on(stage)) for a in actions] == [f"{stage}{a}" for a in actions]


@pytest.mark.parametrize("text", ["", "F", "B", "S0", "X1", "F-1", "F0 ", "2", "FB1", "f0", "2S3"])
def test_a_malformed_action_is_refused(text):
    with pytest.raises(EdgertError, match=r"expected F<micro-batch>, B<micro-batch> or S"):
        Action.parse(text)
