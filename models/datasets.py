"""The small offline data sets the zoo trains on; numpy only (scikit-learn for digits).

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 samples, shipped with
  the package, never downloaded), pixels scaled to [0, 1], stratified seeded split.
- ``synthetic_tokens``: the *majority-marker* task for transformer-mini (see its docstring).
- ``load_npz``: a user's own arrays from an ``.npz`` archive.
- ``load_dataset``: resolves a name or path for a model (digits layout follows the model).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgert.errors import MissingDependencyError
from edgert.models.errors import DatasetError

if TYPE_CHECKING:
    from edgert.models import ModelSpec

DIGITS_LAYOUTS = ("flat", "image")
NAMED_DATASETS = ("digits", "digits-flat", "digits-image", "tokens")


@dataclass(frozen=True, eq=False)
class Dataset:
    """Train and test arrays of one classification task; labels are int64 class indices."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample (the batch dimension left out)."""
        return tuple(self.x_train.shape[1:])


def digits(layout: str = "flat", seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """The 8x8 digits as float32 in [0, 1], flat [N, 64] or image [N, 1, 8, 8]."""
    if layout not in DIGITS_LAYOUTS:
        raise DatasetError(f"digits layout must be one of {DIGITS_LAYOUTS}, got {layout!r}")
    _check_seed(seed)
    _check_fraction(test_fraction)
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise MissingDependencyError(
            f"the digits data set needs scikit-learn ({error}): pip install 'edgert[host]'"
        ) from None
    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    if layout == "image":
        x = x.reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    train, test = _stratified_split(y, test_fraction, np.random.default_rng(seed))
    return Dataset(f"digits-{layout}", x[train], y[train], x[test], y[test], 10)


def synthetic_tokens(
    n_train: int = 2048,
    n_test: int = 512,
    seq_len: int = 16,
    vocab: int = 32,
    num_classes: int = 4,
    seed: int = 0,
) -> Dataset:
    """The majority-marker task: the label is the marker token that occurs most often.

    Tokens ``0 .. num_classes-1`` are markers, the rest fillers. Each sequence holds each
    marker 0..``seq_len // num_classes`` times with exactly one marker most frequent (often
    by one occurrence), filler tokens elsewhere, positions shuffled. Labels are balanced.
    """
    sizes = {"n_train": n_train, "n_test": n_test, "seq_len": seq_len, "vocab": vocab}
    sizes["num_classes"] = num_classes
    for label, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DatasetError(f"{label} must be a positive integer, got {value!r}")
    if num_classes < 2 or seq_len < 2 * num_classes or vocab <= num_classes:
        raise DatasetError(
            "the token task needs 2 <= num_classes, seq_len >= 2 * num_classes and "
            f"vocab > num_classes; got num_classes={num_classes!r}, seq_len={seq_len!r}, "
            f"vocab={vocab!r}"
        )
    _check_seed(seed)
    rng = np.random.default_rng(seed)
    x, y = _majority_marker(n_train + n_test, seq_len, vocab, num_classes, rng)
    return Dataset("tokens", x[:n_train], y[:n_train], x[n_train:], y[n_train:], num_classes)


def load_npz(path: str | Path, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """Arrays ``x``, ``y`` (and optionally ``x_test``, ``y_test``) from an .npz archive.

    Without a test set, a seeded ``test_fraction`` of the samples is split off.
    """
    path = Path(path)
    _check_seed(seed)
    _check_fraction(test_fraction)
    arrays = _read_npz(path)
    has_test = [key in arrays for key in ("x_test", "y_test")]
    if any(has_test) and not all(has_test):
        raise DatasetError(f"{path} has only one of x_test / y_test; give both or neither")
    x, y = _checked_pair(path, arrays, "x", "y")
    if all(has_test):
        x_test, y_test = _checked_pair(path, arrays, "x_test", "y_test")
        if x_test.shape[1:] != x.shape[1:]:
            raise DatasetError(
                f"{path}: x_test samples have shape {x_test.shape[1:]}, x samples {x.shape[1:]}"
            )
    else:
        if len(x) < 2:
            raise DatasetError(f"{path}: cannot split a test set off {len(x)} sample(s)")
        order = np.random.default_rng(seed).permutation(len(x))
        n_test = min(max(1, round(len(x) * test_fraction)), len(x) - 1)
        train, test = order[n_test:], order[:n_test]
        x, y, x_test, y_test = x[train], y[train], x[test], y[test]
    num_classes = int(max(y.max(), y_test.max())) + 1
    return Dataset(path.stem, x, y, x_test, y_test, num_classes)


def load_dataset(
    spec_or_name: str | Path, model_spec: ModelSpec | None = None, seed: int = 0
) -> Dataset:
    """The data set named ``digits``/``digits-flat``/``digits-image``/``tokens``, or an .npz path.

    With ``model_spec``, ``digits`` takes the model's layout, ``tokens`` its sequence length,
    vocabulary and classes, and the result is checked to fit the model's input.
    """
    name = str(spec_or_name)
    if isinstance(spec_or_name, Path) or name.endswith(".npz"):
        dataset = load_npz(spec_or_name, seed=seed)
    elif name in ("digits", "digits-flat", "digits-image"):
        if name == "digits" and model_spec is not None and model_spec.dataset.startswith("digits-"):
            name = model_spec.dataset
        dataset = digits(layout="image" if name == "digits-image" else "flat", seed=seed)
    elif name == "tokens":
        dataset = _tokens_for(model_spec, seed)
    else:
        raise DatasetError(
            f"unknown data set {name!r}; use one of {', '.join(NAMED_DATASETS)} or a .npz path"
        )
    if model_spec is not None:
        _check_fits(dataset, model_spec)
    return dataset


def _majority_marker(
    n: int, seq_len: int, vocab: int, num_classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    most = seq_len // num_classes
    counts = np.empty((0, num_classes), np.int64)
    while len(counts) < n:  # rejection sampling: keep rows with exactly one largest count
        draw = rng.integers(0, most + 1, size=(2 * n, num_classes))
        ordered = np.sort(draw, axis=1)
        counts = np.concatenate([counts, draw[ordered[:, -1] > ordered[:, -2]]])
    counts = counts[:n]
    labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
    # Move each row's largest count to the slot of its (balanced) label.
    top = counts.argmax(axis=1)
    rows = np.arange(n)
    counts[rows, top], counts[rows, labels] = counts[rows, labels], counts[rows, top]
    tokens = rng.integers(num_classes, vocab, size=(n, seq_len))
    for marker in range(num_classes):
        start = counts[:, :marker].sum(axis=1)
        positions = np.arange(seq_len)
        mask = (positions >= start[:, None]) & (positions < (start + counts[:, marker])[:, None])
        tokens[mask] = marker
    return rng.permuted(tokens, axis=1).astype(np.int64), labels


def _stratified_split(
    y: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    train, test = [], []
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        n_test = min(max(1, round(len(members) * test_fraction)), len(members) - 1)
        test.append(members[:n_test])
        train.append(members[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DatasetError(f"data file not found: {path}")
    if not zipfile.is_zipfile(path):
        with path.open("rb") as handle:
            npy = handle.read(6) == b"\x93NUMPY"
        what = "it holds a single .npy array" if npy else "it is not a zip file"
        raise DatasetError(
            f"{path} is not an .npz archive ({what}); "
            "write one with numpy.savez(path, x=..., y=...)"
        )
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in ("x", "y") if key not in archive.files]
            if missing:
                raise DatasetError(
                    f"{path} lacks array(s) {', '.join(missing)}; it has: "
                    f"{', '.join(archive.files) or 'none'}"
                )
            arrays = {key: archive[key] for key in archive.files}
    except ValueError as error:
        if "pickle" in str(error):  # object arrays refuse to load without pickle
            raise DatasetError(f"{path} holds non-numeric (object) data ({error})") from None
        raise DatasetError(f"{path} is not a readable .npz archive ({error})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as error:
        raise DatasetError(f"{path} is not a readable .npz archive ({error})") from None
    broken = [key for key, value in arrays.items() if not isinstance(value, np.ndarray)]
    if broken:  # numpy hands back raw bytes for members that are not .npy data
        raise DatasetError(
            f"{path} is not a readable .npz archive "
            f"(member(s) {', '.join(broken)} are not .npy arrays)"
        )
    return arrays


def _checked_pair(
    path: Path, arrays: dict[str, np.ndarray], x_key: str, y_key: str
) -> tuple[np.ndarray, np.ndarray]:
    x, y = arrays[x_key], arrays[y_key]
    for key, array in ((x_key, x), (y_key, y)):
        if array.dtype.kind not in "biuf":
            raise DatasetError(f"{path}: array {key} is non-numeric (dtype {array.dtype})")
    if x.ndim < 2 or y.ndim != 1:
        raise DatasetError(
            f"{path}: {x_key} must be [samples, features...] and {y_key} [samples]; "
            f"got shapes {x.shape} and {y.shape}"
        )
    if len(x) != len(y):
        raise DatasetError(f"{path}: {x_key} has {len(x)} samples but {y_key} has {len(y)}")
    if len(x) == 0:
        raise DatasetError(f"{path}: {x_key} and {y_key} are empty")
    if y.dtype.kind == "f" and not np.all(np.mod(y, 1) == 0):
        example = y[np.mod(y, 1) != 0][0]
        raise DatasetError(f"{path}: labels {y_key} must be whole numbers, found {example}")
    if y.min() < 0:
        raise DatasetError(f"{path}: labels {y_key} must be >= 0, found {y.min()}")
    x = x.astype(np.float32) if x.dtype.kind in "bf" else x.astype(np.int64)
    return x, y.astype(np.int64)


def _tokens_for(model_spec: ModelSpec | None, seed: int) -> Dataset:
    if model_spec is None or model_spec.dataset != "tokens":
        return synthetic_tokens(seed=seed)
    return synthetic_tokens(
        seq_len=model_spec.input_shape[0],
        vocab=model_spec.vocab_size,
        num_classes=model_spec.num_classes,
        seed=seed,
    )


def _check_fits(dataset: Dataset, model_spec: ModelSpec) -> None:
    if dataset.sample_shape != model_spec.input_shape:
        raise DatasetError(
            f"data set {dataset.name!r} has samples of shape {dataset.sample_shape}, but model "
            f"{model_spec.name!r} takes {model_spec.input_shape}"
        )
    wants_ints = np.dtype(model_spec.input_dtype).kind in "iu"
    if wants_ints != (dataset.x_train.dtype.kind in "iu"):
        raise DatasetError(
            f"data set {dataset.name!r} has {dataset.x_train.dtype} samples, but model "
            f"{model_spec.name!r} takes {model_spec.input_dtype}"
        )
    if model_spec.vocab_size:
        low = min(dataset.x_train.min(), dataset.x_test.min())
        high = max(dataset.x_train.max(), dataset.x_test.max())
        if low < 0 or high >= model_spec.vocab_size:
            raise DatasetError(
                f"data set {dataset.name!r} has token ids {low}..{high}, but model "
                f"{model_spec.name!r} knows ids 0..{model_spec.vocab_size - 1}"
            )
    if dataset.num_classes > model_spec.num_classes:
        raise DatasetError(
            f"data set {dataset.name!r} has {dataset.num_classes} classes, but model "
            f"{model_spec.name!r} predicts {model_spec.num_classes}"
        )


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DatasetError(f"seed must be a non-negative integer, got {seed!r}")


def _check_fraction(test_fraction: float) -> None:
    if not isinstance(test_fraction, (int, float)) or not 0.0 < test_fraction < 1.0:
        raise DatasetError(
            f"test_fraction must be between 0 and 1 (exclusive), got {test_fraction!r}"
        )
