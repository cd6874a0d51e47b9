"""The coordinator's copies: a complete snapshot can be read back whole, from memory or from disk."""

import numpy as np

from edgert.coordinator.snapshots import CentralCopies
from edgert.weights import StageState


def state(step: int, stage: int) -> StageState:
    return StageState(parameters={f"w{stage}": np.full(3, float(step), np.float32)}, optimizer={}, step=step,
                      stage=stage)


def test_a_complete_snapshot_is_read_back_in_stage_order(tmp_path):
    copies = CentralCopies(tmp_path)
    assert not copies.put(state(5, 1), "b", 2, "{}")
    assert copies.put(state(5, 0), "a", 2, "{}")
    got = copies.snapshot(5, 2)
    assert [s.stage for s in got] == [0, 1]
    assert [float(s.parameters[f"w{s.stage}"][0]) for s in got] == [5.0, 5.0]


def test_a_snapshot_whose_copies_memory_dropped_is_read_from_disk(tmp_path):
    copies = CentralCopies(tmp_path)
    for step in (5, 6, 7):  # stage 1 runs ahead; memory keeps only its newest two copies
        copies.put(state(step, 1), "b", 2, "{}")
    assert copies.put(state(5, 0), "a", 2, "{}")
    got = copies.snapshot(5, 2)
    assert [s.step for s in got] == [5, 5]
    assert float(got[1].parameters["w1"][0]) == 5.0
