"""The offline data sets: digits, the majority-marker token task, .npz files, resolution."""

from __future__ import annotations

import sys
import zipfile

import numpy as np
import pytest

from edgert.errors import EdgertError, MissingDependencyError
from edgert.models import get_model_spec
from edgert.models.datasets import Dataset, load_dataset, load_npz
from edgert.models.digits import digits
from edgert.models.errors import DatasetError
from edgert.models.tokens import synthetic_tokens


def _bag_of_tokens(x: np.ndarray, vocab: int) -> np.ndarray:
    return np.stack([np.bincount(row, minlength=vocab) for row in x]).astype(np.float64)


def _logistic_regression_accuracy(data: Dataset, vocab: int) -> float:
    """Full-batch softmax regression on token counts; test accuracy."""
    x_train, x_test = _bag_of_tokens(data.x_train, vocab), _bag_of_tokens(data.x_test, vocab)
    weight = np.zeros((vocab, data.num_classes))
    bias = np.zeros(data.num_classes)
    for _ in range(200):
        logits = x_train @ weight + bias
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        probs[np.arange(len(probs)), data.y_train] -= 1.0
        weight -= 0.5 * x_train.T @ probs / len(probs)
        bias -= 0.5 * probs.mean(axis=0)
    return float(((x_test @ weight + bias).argmax(axis=1) == data.y_test).mean())


# --- digits -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, shape", [("flat", (64,)), ("image", (1, 8, 8))])
def test_digits_shapes_dtypes_and_range(layout: str, shape: tuple[int, ...]) -> None:
    data = digits(layout=layout)
    assert data.name == f"digits-{layout}"
    assert data.x_train.shape == (1438, *shape) and data.x_test.shape == (359, *shape)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert data.x_train.min() >= 0.0 and data.x_train.max() <= 1.0
    assert data.num_classes == 10
    assert data.sample_shape == shape


def test_digits_split_is_stratified_and_fixed_by_the_seed() -> None:
    first, again, other = digits(seed=1), digits(seed=1), digits(seed=2)
    assert np.array_equal(first.x_test, again.x_test) and np.array_equal(
        first.y_train, again.y_train
    )
    assert not np.array_equal(first.x_test, other.x_test)
    per_class = np.bincount(first.y_test, minlength=10)
    assert per_class.min() >= 35 and per_class.max() <= 37  # 20% of 174..183 per class
    flat, image = digits("flat", seed=1), digits("image", seed=1)
    assert np.array_equal(flat.x_train, image.x_train.reshape(-1, 64))


def test_digits_test_fraction_is_honoured() -> None:
    assert len(digits(test_fraction=0.5).x_test) == pytest.approx(1797 / 2, abs=10)


@pytest.mark.parametrize(
    "kwargs, bad",
    [({"layout": "nchw"}, "'nchw'"), ({"test_fraction": 1.0}, "1.0"), ({"seed": -3}, "-3")],
)
def test_digits_bad_arguments(kwargs: dict, bad: str) -> None:
    with pytest.raises(DatasetError, match=bad):
        digits(**kwargs)


def test_digits_without_scikit_learn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(MissingDependencyError, match="edgert\\[host\\]"):
        digits()


# --- the majority-marker token task -------------------------------------------------------


def test_tokens_shapes_dtypes_and_determinism() -> None:
    data = synthetic_tokens(seed=3)
    assert data.x_train.shape == (2048, 16) and data.x_test.shape == (512, 16)
    assert data.x_train.dtype == np.int64 and data.y_train.dtype == np.int64
    assert data.x_train.min() >= 0 and data.x_train.max() < 32
    assert data.num_classes == 4
    again, other = synthetic_tokens(seed=3), synthetic_tokens(seed=4)
    assert np.array_equal(data.x_train, again.x_train) and np.array_equal(data.y_test, again.y_test)
    assert not np.array_equal(data.x_train, other.x_train)


def test_tokens_label_is_the_unique_most_frequent_marker() -> None:
    data = synthetic_tokens(n_train=500, n_test=100, num_classes=5, vocab=20, seq_len=20, seed=1)
    x = np.concatenate([data.x_train, data.x_test])
    y = np.concatenate([data.y_train, data.y_test])
    counts = _bag_of_tokens(x, 20)[:, :5]
    top_two = np.sort(counts, axis=1)[:, -2:]
    assert np.all(top_two[:, 1] > top_two[:, 0])
    assert np.array_equal(counts.argmax(axis=1), y)
    assert np.all(np.bincount(y) == 120)  # labels are balanced


def test_tokens_task_is_learnable_well_above_chance() -> None:
    data = synthetic_tokens(seed=0)
    accuracy = _logistic_regression_accuracy(data, vocab=32)
    assert accuracy >= 0.25 + 0.6  # chance is 1/4; a bag-of-tokens model gets ~1.0


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"n_train": 0}, "n_train"),
        ({"num_classes": 1}, "num_classes=1"),
        ({"seq_len": 6}, "seq_len=6"),
        ({"vocab": 4}, "vocab=4"),
        ({"seed": -1}, "-1"),
        ({"seq_len": 16.0}, "seq_len must be a positive integer, got 16.0"),
    ],
)
def test_tokens_bad_arguments(kwargs: dict, bad: str) -> None:
    with pytest.raises(DatasetError, match=bad):
        synthetic_tokens(**kwargs)


# --- .npz files ---------------------------------------------------------------------------


def test_npz_with_x_and_y_splits_off_a_seeded_fifth(tmp_path) -> None:
    path = tmp_path / "mine.npz"
    x = np.arange(100 * 3, dtype=np.float64).reshape(100, 3)
    np.savez(path, x=x, y=np.arange(100) % 3)
    data = load_npz(path, seed=7)
    assert data.name == "mine" and data.num_classes == 3
    assert data.x_train.shape == (80, 3) and data.x_test.shape == (20, 3)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert np.array_equal(load_npz(path, seed=7).x_test, data.x_test)
    assert not np.array_equal(load_npz(path, seed=8).x_test, data.x_test)
    everything = np.sort(np.concatenate([data.x_train[:, 0], data.x_test[:, 0]]))
    assert np.array_equal(everything, x[:, 0])


def test_npz_with_its_own_test_set_and_integer_tokens(tmp_path) -> None:
    path = tmp_path / "tok.npz"
    x = np.ones((10, 16), np.int32)
    np.savez(path, x=x, y=np.zeros(10), x_test=x[:4], y_test=np.array([0, 1, 2, 1]))
    data = load_npz(path)
    assert data.x_train.dtype == np.int64 and len(data.x_test) == 4 and data.num_classes == 3


def _save(tmp_path, **arrays) -> str:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((4, 2))}, "lacks array\\(s\\) y; it has: x"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(4), "x_test": np.zeros((1, 2))}, "only one of"),
        ({"x": np.zeros((4, 2)), "y": np.zeros(3)}, "x has 4 samples but y has 3"),
        ({"x": np.array([["a", "b"]] * 2), "y": np.zeros(2)}, "non-numeric \\(dtype <U1\\)"),
        ({"x": np.zeros(4), "y": np.zeros(4)}, "got shapes \\(4,\\) and \\(4,\\)"),
        ({"x": np.zeros((0, 2)), "y": np.zeros(0)}, "empty"),
        ({"x": np.zeros((2, 2)), "y": np.array([0.0, 1.5])}, "whole numbers, found 1.5"),
        ({"x": np.zeros((2, 2)), "y": np.array([0, -1])}, ">= 0, found -1"),
        ({"x": np.zeros((1, 2)), "y": np.zeros(1)}, "cannot split a test set off 1"),
        (
            {"x": np.zeros((4, 2)), "y": np.zeros(4), "x_test": np.zeros((1, 3)), "y_test": [0]},
            "x_test samples have shape \\(3,\\), x samples \\(2,\\)",
        ),
    ],
)
def test_npz_bad_contents(tmp_path, arrays: dict, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        load_npz(_save(tmp_path, **arrays))


def test_npz_object_arrays_are_non_numeric(tmp_path) -> None:
    path = _save(tmp_path, x=np.array([{"a": 1}, None], dtype=object), y=np.zeros(2))
    with pytest.raises(DatasetError, match="non-numeric"):
        load_npz(path)


def test_npz_missing_file_and_not_an_archive(tmp_path) -> None:
    with pytest.raises(DatasetError, match="not found: .*nothing.npz"):
        load_npz(tmp_path / "nothing.npz")
    text = tmp_path / "text.npz"
    text.write_text("x,y\n1,2\n")
    with pytest.raises(DatasetError, match="not an .npz archive \\(it is not a zip file"):
        load_npz(text)
    single = tmp_path / "single.npz"
    with open(single, "wb") as handle:
        np.save(handle, np.zeros(3))
    with pytest.raises(DatasetError, match="it holds a single .npy array"):
        load_npz(single)
    broken = tmp_path / "broken.npz"
    with zipfile.ZipFile(broken, "w") as archive:
        archive.writestr("x.npy", b"garbage")
        archive.writestr("y.npy", b"garbage")
    with pytest.raises(DatasetError, match="not a readable .npz archive"):
        load_npz(broken)
    assert issubclass(DatasetError, EdgertError)


# --- resolution for a model ---------------------------------------------------------------


@pytest.mark.parametrize(
    "model, shape, dtype",
    [
        ("mlp", (64,), np.float32),
        ("cnn", (1, 8, 8), np.float32),
        ("resnet-mini", (1, 8, 8), np.float32),
        ("mobilenet-mini", (1, 8, 8), np.float32),
        ("transformer-mini", (16,), np.int64),
    ],
)
def test_load_dataset_fits_each_zoo_model(model: str, shape: tuple, dtype: type) -> None:
    spec = get_model_spec(model)
    data = load_dataset(spec.dataset.split("-")[0], spec)
    assert data.sample_shape == shape == spec.input_shape
    assert data.x_train.dtype == dtype
    assert data.num_classes == spec.num_classes


def test_load_dataset_without_a_model() -> None:
    assert load_dataset("digits").sample_shape == (64,)
    assert load_dataset("digits-image").sample_shape == (1, 8, 8)
    assert load_dataset("tokens").sample_shape == (16,)


def test_load_dataset_reads_npz_paths(tmp_path) -> None:
    path = tmp_path / "flat.npz"
    np.savez(path, x=np.random.default_rng(0).random((20, 64)), y=np.arange(20) % 10)
    spec = get_model_spec("mlp")
    assert load_dataset(str(path), spec).sample_shape == (64,)
    assert load_dataset(path).num_classes == 10


def test_load_dataset_refusals(tmp_path) -> None:
    with pytest.raises(DatasetError, match="unknown data set 'mnist'.*digits, .*tokens"):
        load_dataset("mnist")
    with pytest.raises(DatasetError, match="shape \\(64,\\).*takes \\(16,\\)"):
        load_dataset("digits", get_model_spec("transformer-mini"))
    with pytest.raises(DatasetError, match="shape \\(16,\\).*takes \\(64,\\)"):
        load_dataset("tokens", get_model_spec("mlp"))
    wide = tmp_path / "wide.npz"
    np.savez(wide, x=np.full((10, 16), 40), y=np.zeros(10, np.int64))
    with pytest.raises(DatasetError, match="token ids 40..40.*0..31"):
        load_dataset(wide, get_model_spec("transformer-mini"))
    floats = tmp_path / "floats.npz"
    np.savez(floats, x=np.zeros((10, 16)), y=np.zeros(10, np.int64))
    with pytest.raises(DatasetError, match="float32 samples.*takes int64"):
        load_dataset(floats, get_model_spec("transformer-mini"))
    many = tmp_path / "many.npz"
    np.savez(many, x=np.zeros((20, 64)), y=np.arange(20))
    with pytest.raises(DatasetError, match="20 classes.*predicts 10"):
        load_dataset(many, get_model_spec("mlp"))
