"""``edgert evaluate`` and ``edgert predict``: a trained model used without code, its figures checked as numbers,
and every bad input one ``error:`` line from the real command."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime
import pytest
from click.testing import CliRunner

from edgert.cli import main
from edgert.models import build_model, save_model
from tests.cli.test_cli_errors import assert_one_line_error, edgert

PIL = pytest.importorskip("PIL.Image", reason="Pillow reads images (pip install pillow)")
NAMES = [f"digit-{k}" for k in range(10)]


def with_metadata(model, **values):
    for key, value in values.items():
        model.metadata_props.add(key=f"edgert.{key}", value=value)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The zoo mlp (with class names recorded, as a merge records them), the zoo cnn, and data for them."""
    folder = tmp_path_factory.mktemp("use")
    save_model(with_metadata(build_model("mlp", seed=1), classes=json.dumps(NAMES)), folder / "mlp.onnx")
    save_model(build_model("cnn", seed=1), folder / "cnn.onnx")
    fixed = build_model("mlp", seed=1)  # exported with a fixed batch of 5, as some exporters write models
    for value in (*fixed.graph.input, *fixed.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 5
    save_model(fixed, folder / "mlp-batch5.onnx")
    rng = np.random.default_rng(0)
    np.savez(folder / "data.npz", x=rng.random((103, 64), np.float32), y=rng.integers(0, 10, 103))
    np.save(folder / "rows.npy", rng.random((4, 64), np.float32))
    np.save(folder / "wrong.npy", rng.random((4, 32), np.float32))
    (folder / "pics" / "seven").mkdir(parents=True)
    for k in range(2):
        PIL.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(folder / "pics" / "seven" / f"{k}.png")
    return folder


def run_json(*args):
    result = CliRunner().invoke(main, [*map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def logits(path, x):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0].astype(np.float64)


def test_evaluate_scores_the_seeded_test_split_in_batches(files):
    from edgert.models.npz_data import load_npz

    scored = run_json("evaluate", files / "mlp.onnx", "--data", files / "data.npz", "--seed", 3, "--batch-size", 10)[0]
    data = load_npz(files / "data.npz", seed=3)
    out = logits(files / "mlp.onnx", data.x_test)
    log_probs = out - out.max(1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(1, keepdims=True))
    assert scored["samples"] == len(data.y_test) == 21
    assert scored["loss"] == pytest.approx(-log_probs[np.arange(21), data.y_test].mean(), rel=1e-6)
    assert scored["accuracy"] == pytest.approx(np.mean(out.argmax(1) == data.y_test), abs=1e-12)
    assert run_json("evaluate", files / "mlp.onnx", "--data", files / "data.npz", "--split", "all")[0]["samples"] == 103


def test_a_model_with_a_fixed_batch_is_fed_padded_batches(files):
    dynamic = run_json("evaluate", files / "mlp.onnx", "--data", files / "data.npz", "--split", "train")[0]
    fixed = run_json("evaluate", files / "mlp-batch5.onnx", "--data", files / "data.npz", "--split", "train")[0]
    assert fixed["samples"] == dynamic["samples"] == 82  # not a multiple of 5
    assert fixed["loss"] == pytest.approx(dynamic["loss"], rel=1e-6) and fixed["accuracy"] == dynamic["accuracy"]


def test_a_long_evaluation_shows_progress(files, monkeypatch):
    monkeypatch.setattr("edgert.cli.inference.PROGRESS_DELAY", 0.0)
    result = CliRunner().invoke(main, ["evaluate", str(files / "mlp.onnx"), "--data", str(files / "data.npz"),
                                       "--split", "all", "--batch-size", 50])
    assert result.exit_code == 0, result.output
    assert "evaluating [" in result.stderr and "103/103" in result.stderr
    assert result.stdout.strip().endswith("accuracy " + result.stdout.strip().split("accuracy ")[-1])


def test_predict_gives_the_top_classes_with_their_names(files):
    lines = run_json("predict", files / "mlp.onnx", files / "rows.npy", "--top", 2)
    rows = np.load(files / "rows.npy")
    out = logits(files / "mlp.onnx", rows)
    probabilities = np.exp(out - out.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    assert [line["input"] for line in lines] == [f"{files / 'rows.npy'}[{k}]" for k in range(4)]
    for line, expected in zip(lines, probabilities):
        best = np.argsort(-expected)[:2]
        assert [t["class"] for t in line["top"]] == best.tolist()
        assert [t["name"] for t in line["top"]] == [NAMES[k] for k in best]
        np.testing.assert_allclose([t["probability"] for t in line["top"]], expected[best], rtol=1e-6)
    text = CliRunner().invoke(main, ["predict", str(files / "mlp.onnx"), str(files / "rows.npy")]).stdout
    assert text.splitlines()[0].startswith(f"{files / 'rows.npy'}[0]: digit-")


def test_predict_reads_one_sample_npz_and_image_files(files):
    np.save(files / "one.npy", np.load(files / "rows.npy")[1])
    np.savez(files / "x.npz", x=np.load(files / "rows.npy"))
    one = run_json("predict", files / "mlp.onnx", files / "one.npy")
    archive = run_json("predict", files / "mlp.onnx", files / "x.npz")
    assert len(one) == 1 and one[0]["top"] == archive[1]["top"]
    from edgert.models.image_folder import read_image

    images = run_json("predict", files / "cnn.onnx", files / "pics")  # a folder: every image in it
    assert [line["input"] for line in images] == [str(files / "pics" / "seven" / f"{k}.png") for k in range(2)]
    out = logits(files / "cnn.onnx", read_image(files / "pics" / "seven" / "0.png", (1, 8, 8))[None])
    assert images[0]["top"][0]["class"] == int(out.argmax())


def test_a_board_without_a_run_record_is_asked_for_data(files):
    assert_one_line_error(edgert("evaluate", files / "mlp.onnx"), "records no data set", "give --data")


@pytest.mark.parametrize("args,fragments", [
    (["evaluate", "{f}/none.onnx", "--data", "{f}/data.npz"], ["model not found: {f}/none.onnx"]),
    (["evaluate", "{f}/data.npz", "--data", "{f}/data.npz"], ["{f}/data.npz: not a model onnxruntime can load"]),
    (["evaluate", "{f}/mlp.onnx", "--data", "{f}/none.npz"], ["data file not found: {f}/none.npz"]),
    (["evaluate", "{f}/mlp.onnx", "--data", "{f}/table.csv", "--label-column", "kind"],
     ["{f}/table.csv has no column 'kind'"]),
    (["evaluate", "{f}/cnn.onnx", "--data", "{f}/empty"], ["{f}/empty: no class folders"]),
    (["evaluate", "{f}/mlp.onnx", "--data", "{f}/pics"], ["images need a model input [N, C, H, W]", "[N, 64]"]),
    (["evaluate", "{f}/cnn.onnx", "--data", "{f}/data.npz"],
     ["data set 'data' has samples of shape (64,), but model 'cnn' takes (1, 8, 8)"]),
    (["evaluate", "{f}/mlp.onnx", "--data", "{f}/many.npz"],
     ["data set 'many' has 12 classes, but model 'mlp' predicts 10"]),
    (["predict", "{f}/mlp.onnx", "{f}/wrong.npy"],
     ["{f}/wrong.npy: samples of shape [32], but the model's input 'input' takes [N, 64]"]),
    (["predict", "{f}/mlp.onnx", "{f}/none.npy"], ["input not found: {f}/none.npy"]),
    (["predict", "{f}/mlp.onnx", "{f}/table.csv"], ["not an input edgert predict reads"]),
    (["predict", "{f}/mlp.onnx", "{f}/pics/seven/0.png"], ["images need a model input [N, C, H, W]"]),
    (["predict", "{f}/cnn.onnx", "{f}/empty"], ["{f}/empty: no image files"]),
    (["evaluate", "{f}/mlp.onnx", "--run", "{f}"], ["{f}/data.json: missing"]),
])
def test_bad_input_is_one_line_naming_the_problem(files, args, fragments):
    (files / "table.csv").write_text("a,b,label\n1,2,0\n3,4,1\n")
    (files / "empty").mkdir(exist_ok=True)
    np.savez(files / "many.npz", x=np.zeros((10, 64), np.float32), y=np.arange(10) + 2)
    result = edgert(*(a.format(f=files) for a in args))
    assert_one_line_error(result, *(fragment.format(f=files) for fragment in fragments))


def test_a_regression_model_shows_its_outputs(files):
    model = onnx.load(str(files / "mlp.onnx"))
    save_model(with_metadata(model, loss="mse"), files / "regression.onnx")
    lines = run_json("predict", files / "regression.onnx", files / "rows.npy")
    np.testing.assert_allclose([line["outputs"] for line in lines], logits(files / "mlp.onnx",
                                                                            np.load(files / "rows.npy")), rtol=1e-6)
