"""tools/conv_forms.py: every form of a layer's gradients it times computes the same numbers (the training build's,
where it is installed)."""

import json
import subprocess
import sys
from pathlib import Path

from edgert.ort_import import training_folder

TOOL = Path(__file__).resolve().parents[2] / "tools" / "conv_forms.py"


def test_each_form_of_a_layer_is_timed_and_gives_the_training_builds_gradients():
    # 16 channels on 6x6 widening to 24 with a 3x3 kernel: every alternative differs from the chosen form
    result = subprocess.run([sys.executable, str(TOOL), "--shapes", "16,6,24,3,1/8,5,8,3,2,8", "--rounds", "2",
                             "--batch", "3", "--json"], capture_output=True, text=True, timeout=120, check=True)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["layer"] for row in rows] == ["C16 6x6 M24 k3 s1", "C8 5x5 M8 k3 s2 g8"]
    training = {"training"} if training_folder() is not None else set()
    assert set(rows[0]["ms"]) == {"chosen", "channels_first", "swapped", "flipped_dx"} | training
    assert set(rows[1]["ms"]) == {"chosen", "swapped"} | training  # depthwise: products, or the swapped Conv
    for row in rows:
        assert row["max_relative_error"] < 1e-5
        assert all(ms > 0 for ms in row["ms"].values())
