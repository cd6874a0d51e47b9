"""A folder of images in class subfolders (the layout torchvision's ImageFolder reads), decoded as needed.

The format (docs/MODELS.md, "a folder of images"): ``ROOT/<class>/**/<image>``, one subfolder
per class, class indices in the sorted order of the folder names (hidden folders ignored);
images are the files with the suffixes of :data:`IMAGE_SUFFIXES`. ``ROOT/train/<class>/...``
beside ``ROOT/test/<class>/...`` (or ``val``) gives the test set; otherwise a seeded,
stratified fraction is split off.

Every image is prepared the same way (:func:`read_image`), in training, ``edgert evaluate`` and
``edgert predict``: converted to grey (a model input of 1 channel) or RGB (3), centre-cropped to
the input's aspect ratio, resized to its height and width (bilinear), scaled to [0, 1] as
float32, channels first ``[C, H, W]``. Images are decoded when their rows are asked for, a few
threads at a time, so a folder of any size trains in bounded memory. Decoding needs Pillow
(``pip install pillow``), imported only when a folder of images is read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edgert.errors import MissingDependencyError
from edgert.models.errors import DatasetError
from edgert.models.samples import Dataset, check_fraction, check_seed, stratified_split

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
TEST_FOLDERS = ("test", "val")  # beside ``train``: the test set
CHANNEL_MODES = {1: "L", 3: "RGB"}  # channels of the model's input -> the Pillow mode images are converted to
DECODE_THREADS = min(4, os.cpu_count() or 1)


def load_image_folder(root: str | Path, sample_shape: Sequence[int] | None, seed: int = 0,
                      test_fraction: float = 0.2) -> Dataset:
    """The images under ``root``, prepared for a model input of ``sample_shape`` ``(C, H, W)``."""
    root = Path(root)
    check_seed(seed)
    check_fraction(test_fraction)
    if not root.is_dir():
        raise DatasetError(f"data folder not found: {root}")
    shape = image_shape(sample_shape, str(root))
    pillow()
    split = _split_folders(root)
    if split is not None:
        classes, train_files, y_train = _class_files(split[0])
        _, test_files, y_test = _class_files(split[1], classes)
    else:
        classes, files, labels = _class_files(root)
        train, test = stratified_split(labels, test_fraction, seed, str(root))
        train_files, y_train, test_files, y_test = files[train], labels[train], files[test], labels[test]
    return Dataset(root.name, ImageRows(train_files, shape), y_train, ImageRows(test_files, shape), y_test,
                   len(classes), tuple(classes))


def image_shape(sample_shape: Sequence[int] | None, what: str) -> tuple[int, int, int]:
    """``sample_shape`` as ``(channels, height, width)``, refused unless images can be prepared for it."""
    if sample_shape is None:
        raise DatasetError(f"{what}: images are resized to the model's input, and no model input was given")
    shape = tuple(sample_shape)
    if len(shape) != 3 or shape[0] not in CHANNEL_MODES or not all(isinstance(d, int) and d > 0 for d in shape):
        raise DatasetError(f"{what}: images need a model input [N, C, H, W] with C 1 (grey) or 3 (RGB) and fixed "
                           f"H, W; this model takes [N, {', '.join(str(d) for d in shape)}]")
    return shape


def read_image(path: str | Path, shape: tuple[int, int, int]) -> np.ndarray:
    """One image file prepared for an input of ``shape`` ``(C, H, W)``: float32 in [0, 1], channels first."""
    image_module = pillow()
    channels, height, width = shape
    try:
        with image_module.open(path) as image:
            image = image.convert(CHANNEL_MODES[channels])
            image = image.crop(_centre_box(image.size, width / height))
            image = image.resize((width, height), image_module.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.float32) / 255.0
    except FileNotFoundError:
        raise DatasetError(f"image not found: {path}") from None
    except (OSError, ValueError, image_module.DecompressionBombError) as error:
        raise DatasetError(f"{path}: not an image Pillow can read ({error})") from None
    return pixels[None] if channels == 1 else pixels.transpose(2, 0, 1).copy()


def pillow():
    """``PIL.Image``, or a one-line error saying how to install it."""
    try:
        from PIL import Image
    except ImportError:
        raise MissingDependencyError("reading images needs Pillow: pip install pillow") from None
    return Image


class ImageRows:
    """Image files as rows ``[C, H, W]``: ``rows[indices]`` decodes those files (a few threads at once)."""

    def __init__(self, files: np.ndarray, shape: tuple[int, int, int]):
        self.files = files
        self.shape = (len(files), *shape)
        self.dtype = np.dtype(np.float32)
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int | slice | np.ndarray) -> np.ndarray:
        chosen = self.files[index]
        if np.ndim(chosen) == 0:
            return read_image(chosen, self.shape[1:])
        if self._pool is None:
            self._pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="edgert-images")
        images = list(self._pool.map(lambda f: read_image(f, self.shape[1:]), chosen))
        return np.stack(images) if images else np.empty((0, *self.shape[1:]), np.float32)


def _centre_box(size: tuple[int, int], aspect: float) -> tuple[int, int, int, int]:
    """The largest centred box of ``size`` with width / height ``aspect``."""
    width, height = size
    if width / height > aspect:
        crop = round(height * aspect)
        return ((width - crop) // 2, 0, (width - crop) // 2 + crop, height)
    crop = round(width / aspect)
    return (0, (height - crop) // 2, width, (height - crop) // 2 + crop)


def _split_folders(root: Path) -> tuple[Path, Path] | None:
    """``root/train`` and ``root/test`` (or ``val``) when both hold class folders, not images."""
    train = root / "train"
    tests = [root / name for name in TEST_FOLDERS if (root / name).is_dir()]
    if not train.is_dir() or not tests or not _subfolders(train) or _images_in(train, recursive=False):
        return None
    return train, tests[0]


def _class_files(root: Path, classes: list[str] | None = None) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The class names (sorted folder names, or ``classes``) and every image file with its class index."""
    found = [folder.name for folder in _subfolders(root)]
    if not found:
        raise DatasetError(f"{root}: no class folders (a folder of images holds one subfolder per class: "
                           f"{root}/<class>/<image>.jpg)")
    if classes is None:
        classes = found
    else:
        unknown = sorted(set(found) - set(classes))
        if unknown:
            raise DatasetError(f"{root}: class folder(s) {', '.join(unknown[:5])} are not among the training set's "
                               f"classes ({', '.join(classes[:10])})")
    files, labels, empty = [], [], []
    for index, name in enumerate(classes):
        members = _images_in(root / name, recursive=True) if (root / name).is_dir() else []
        if not members and name in found:
            empty.append(name)
        files += members
        labels += [index] * len(members)
    if empty:
        raise DatasetError(f"{root}: class folder(s) {', '.join(empty[:5])} hold no images "
                           f"({', '.join(IMAGE_SUFFIXES)})")
    return classes, np.array(files, dtype=object), np.array(labels, dtype=np.int64)


def _subfolders(root: Path) -> list[Path]:
    return sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


def _images_in(folder: Path, recursive: bool) -> list[str]:
    found = folder.rglob("*") if recursive else folder.iterdir()
    return sorted(str(p) for p in found if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
