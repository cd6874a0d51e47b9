"""Your own arrays: an ``.npz`` archive of ``x``, ``y`` (``x_test``, ``y_test``, ``classes`` optional).

The format (docs/MODELS.md, "your own data"): ``numpy.savez(path, x=..., y=...)``; floats
become float32, integers int64 token ids; labels are whole numbers >= 0; ``classes`` (strings)
names the class indices. The archive is read whole into memory: for data larger than that,
use a CSV or a folder of images (csv_data.py, image_folder.py), which are read as needed.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from edgert.models.errors import DatasetError
from edgert.models.samples import Dataset, check_fraction, check_seed, seeded_split


def load_npz(path: str | Path, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """Arrays ``x``, ``y`` (and optionally ``x_test``, ``y_test``, ``classes``) from an .npz archive.

    Without a test set, a seeded ``test_fraction`` of the samples is split off.
    """
    path = Path(path)
    check_seed(seed)
    check_fraction(test_fraction)
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
        train, test = seeded_split(len(x), test_fraction, seed, str(path))
        x, y, x_test, y_test = x[train], y[train], x[test], y[test]
    num_classes = int(max(y.max(), y_test.max())) + 1
    classes = _class_names(path, arrays, num_classes)
    return Dataset(path.stem, x, y, x_test, y_test, max(num_classes, len(classes or ())), classes)


def _class_names(path: Path, arrays: dict[str, np.ndarray], num_classes: int) -> tuple[str, ...] | None:
    """The archive's ``classes``: one name per class index, at least as many as the labels need."""
    if "classes" not in arrays:
        return None
    names = arrays["classes"]
    if names.ndim != 1 or names.dtype.kind not in "US":
        raise DatasetError(f"{path}: classes must be a 1-D array of strings, got {names.dtype}{list(names.shape)}")
    if len(names) < num_classes:
        raise DatasetError(f"{path}: classes names {len(names)} classes, but the labels go up to {num_classes - 1}")
    return tuple(str(n.decode() if isinstance(n, bytes) else n) for n in names)


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
