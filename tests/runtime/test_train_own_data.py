"""A user's own data end to end, with no code: ``edgert train --data`` on a folder of images and on a CSV, then
``edgert merge``, ``edgert evaluate`` (the run's split, from what the run recorded) and ``edgert predict``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.models import load_dataset
from tests.cli.test_cli_errors import edgert
from tests.zoo_plans import zoo_plan

PIL = pytest.importorskip("PIL.Image", reason="Pillow reads images (pip install pillow)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def train_merge_evaluate(tmp_path, model: str, data_args: list, evaluate_args: list):
    """Train ``model`` (2 stages, 2 local workers, one epoch) on ``data_args``, merge it and evaluate it:
    (the merged model, the run's last eval record, evaluate's JSON)."""
    plan = zoo_plan(tmp_path, 2, model)
    with LocalCluster(2, log_dir=tmp_path / "logs") as cluster:
        trained = edgert("train", plan, "--insecure", "--workers", ",".join(cluster.urls), "--epochs", 1,
                         "--batch-size", 32, "--listen", "coap+tcp://127.0.0.1:0", "--out", tmp_path / "run",
                         *data_args)
    assert trained.returncode == 0, trained.stderr
    merged = edgert("merge", tmp_path / "run", "-o", tmp_path / "trained.onnx")
    assert merged.returncode == 0, merged.stderr
    scored = edgert("evaluate", tmp_path / "trained.onnx", "--json", *evaluate_args)
    assert scored.returncode == 0, scored.stderr
    last = [m for m in read_metrics(tmp_path / "run") if m["type"] == "eval"][-1]
    return tmp_path / "trained.onnx", last, json.loads(scored.stdout.strip().splitlines()[-1])


def test_a_folder_of_images_trains_merges_and_is_used(tmp_path):
    digits = load_dataset("digits-image")
    root = tmp_path / "digits"
    for k, (image, label) in enumerate(zip(np.concatenate([digits.x_train, digits.x_test]),
                                           np.concatenate([digits.y_train, digits.y_test]))):
        (root / NAMES[label]).mkdir(parents=True, exist_ok=True)
        PIL.fromarray(np.round(image[0] * 255).astype(np.uint8)).save(root / NAMES[label] / f"{k}.png")
    model, last, scored = train_merge_evaluate(tmp_path, "cnn", ["--data", root], [])
    record = json.loads((tmp_path / "run" / "data.json").read_text())
    assert record["source"] == str(root) and record["classes"] == sorted(NAMES) and record["test_samples"] == 359
    assert scored["samples"] == 359 and scored["data"] == "digits"
    assert scored["accuracy"] == pytest.approx(last["test_accuracy"], abs=1e-12)
    assert scored["loss"] == pytest.approx(last["test_loss"], rel=1e-5)
    assert last["test_accuracy"] > 0.5  # it learnt from the images (chance: 0.1)
    picked = sorted((root / "seven").iterdir())[:3]
    predicted = edgert("predict", model, *picked, "--top", 1)
    assert predicted.returncode == 0, predicted.stderr
    lines = predicted.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [str(p) for p in picked]
    assert all(line.split(": ")[1].split()[0] in NAMES for line in lines)  # class names, not indices


def test_a_csv_with_named_labels_trains_merges_and_is_evaluated_from_the_run(tmp_path):
    digits = load_dataset("digits-flat")
    x = np.concatenate([digits.x_train, digits.x_test])
    y = np.concatenate([digits.y_train, digits.y_test])
    lines = ["digit," + ",".join(f"p{k}" for k in range(64))]
    lines += [NAMES[label] + "," + ",".join(f"{v:.9g}" for v in row) for row, label in zip(x, y)]
    (tmp_path / "digits.csv").write_text("\n".join(lines) + "\n")
    _, last, scored = train_merge_evaluate(tmp_path, "mlp", ["--data", tmp_path / "digits.csv",
                                                             "--label-column", "digit", "--seed", 2],
                                           ["--run", tmp_path / "run"])
    assert scored["samples"] == 359 and scored["seed"] == 2
    assert scored["accuracy"] == pytest.approx(last["test_accuracy"], abs=1e-12)
    assert scored["loss"] == pytest.approx(last["test_loss"], rel=1e-5)
    assert last["test_accuracy"] > 0.5
