"""Data beyond .npz: a CSV streamed into a memory map, a folder of images decoded as needed, a run's data.json."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from edgert.errors import MissingDependencyError
from edgert.models import csv_data
from edgert.models.csv_data import load_csv
from edgert.models.data_settings import DataRecord, DataSettings, read_data_record, write_data_record
from edgert.models.datasets import load_dataset
from edgert.models.errors import DatasetError
from edgert.models.samples import RowSubset

PIL = pytest.importorskip("PIL.Image", reason="Pillow reads images (pip install pillow)")


def write_csv(path, x, labels, label_column="label", label_first=False):
    header = [f"f{k}" for k in range(x.shape[1])]
    rows = [[f"{v:.9g}" for v in row] for row in x]  # 9 digits: float32 exactly
    if label_first:
        lines = [",".join([label_column, *header])] + [",".join([str(lab), *row]) for lab, row in zip(labels, rows)]
    else:
        lines = [",".join([*header, label_column])] + [",".join([*row, str(lab)]) for lab, row in zip(labels, rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


# -- CSV -------------------------------------------------------------------------------------------

def test_a_csv_reads_features_and_class_indices_through_a_memory_map(tmp_path, monkeypatch):
    monkeypatch.setattr(csv_data, "CHUNK_ROWS", 7)  # several chunks, and the last one short
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 5)).astype(np.float32)
    y = np.arange(50) % 3
    data = load_csv(write_csv(tmp_path / "d.csv", x, y, label_first=True), seed=1)
    assert isinstance(data.x_train, RowSubset) and isinstance(data.x_train._rows, np.memmap)
    assert data.classes is None and data.num_classes == 3 and data.sample_shape == (5,)
    assert len(data.x_train) + len(data.x_test) == 50 and len(data.x_test) == 9  # a fifth of each class: 3 + 3 + 3
    both = np.concatenate([data.x_train[np.arange(len(data.x_train))], data.x_test[:]])
    labels = np.concatenate([data.y_train, data.y_test])
    # every row comes back with its own label, in float32 exactly as written
    by_row = {tuple(row): label for row, label in zip(x, y)}
    assert all(by_row[tuple(row)] == label for row, label in zip(both, labels))
    picked = np.array([5, 0, 5, 2])  # unsorted, repeated: the rows asked for, in that order
    np.testing.assert_array_equal(data.x_train[picked], np.stack([data.x_train[int(k)] for k in picked]))


def test_the_csv_split_is_fixed_by_the_seed(tmp_path):
    path = write_csv(tmp_path / "d.csv", np.arange(80, dtype=np.float32).reshape(40, 2), np.arange(40) % 4)
    first, again, other = load_csv(path, seed=3), load_csv(path, seed=3), load_csv(path, seed=4)
    np.testing.assert_array_equal(first.x_test[:], again.x_test[:])
    assert not np.array_equal(first.x_test[:], other.x_test[:])


def test_label_names_become_sorted_classes(tmp_path):
    x = np.zeros((12, 2), np.float32)
    names = ["dog", "cat", "bird"] * 4
    data = load_csv(write_csv(tmp_path / "d.csv", x, names, label_column="species"), label_column="species")
    assert data.classes == ("bird", "cat", "dog") and data.num_classes == 3
    assert sorted(np.concatenate([data.y_train, data.y_test]).tolist()) == [0] * 4 + [1] * 4 + [2] * 4


def test_the_csv_copy_is_not_left_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    load_csv(write_csv(tmp_path / "d.csv", np.ones((10, 2), np.float32), np.arange(10) % 2))
    bad = tmp_path / "bad.csv"
    bad.write_text("a,label\n1,0\nx,1\n")
    with pytest.raises(DatasetError):
        load_csv(bad)
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("text,message", [
    ("", "is empty: a CSV needs a header row"),
    ("a,b,c\n1,2,3\n", "has no column 'label' (its columns: a, b, c); name the label column with --label-column"),
    ("label\n1\n2\n", "only the label column 'label', no feature columns"),
    ("a,label\n1,0\n2\n", "line 3: 1 fields, the header has 2"),
    ("a,b,label\n1,2,0\n1,oops,1\n", "line 3: column 'b' holds 'oops', not a number"),
    ("a,label\n1,0\n2,\n", "line 3: the label column 'label' is empty"),
    ("a,label\n1,0\n2,-1\n3,1\n", "label column 'label' holds '-1'; labels are whole numbers >= 0"),
    ("a,label\n1,0\n", "1 data row(s); a test set needs at least 2"),
    ("a,label\n1,0\n2,1\n", "no class has two samples"),
])
def test_bad_csv_files_are_one_line_naming_the_problem(tmp_path, text, message):
    path = tmp_path / "d.csv"
    path.write_text(text)
    with pytest.raises(DatasetError) as error:
        load_csv(path)
    assert message in str(error.value) and str(path) in str(error.value)
    assert "\n" not in str(error.value)


def test_a_missing_csv_is_named(tmp_path):
    with pytest.raises(DatasetError, match="data file not found: .*nothing.csv"):
        load_dataset(tmp_path / "nothing.csv")


def test_a_large_csv_streams_with_progress(tmp_path, monkeypatch):
    """Read in chunks: progress after each, and the features are never one array in memory."""
    monkeypatch.setattr(csv_data, "CHUNK_ROWS", 1000)
    rng = np.random.default_rng(1)
    x = rng.random((5000, 8)).astype(np.float32)
    path = write_csv(tmp_path / "big.csv", x, np.arange(5000) % 10)
    seen = []
    data = load_dataset(path, progress=lambda done, total: seen.append((done, total)))
    assert len(seen) == 5 and all(total == path.stat().st_size for _, total in seen)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen) and seen[-1][0] == seen[-1][1]
    assert data.x_train.shape == (4000, 8) and data.x_train[np.arange(3)].dtype == np.float32


# -- a folder of images ------------------------------------------------------------------------------

def write_images(root, per_class=4, size=(12, 10), classes=("cat", "dog", "emu"), mode="RGB"):
    rng = np.random.default_rng(0)
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            pixels[..., 0] = 60 * k  # the red channel tells the class
            PIL.fromarray(pixels).convert(mode).save(root / name / f"{i}.png")
    return root


def test_an_image_folder_is_classes_by_subfolder_decoded_on_demand(tmp_path):
    root = write_images(tmp_path / "pics")
    (tmp_path / "pics" / ".hidden").mkdir()
    (tmp_path / "pics" / "cat" / "notes.txt").write_text("not an image")
    data = load_dataset(root, sample_shape=(3, 8, 8), seed=0)
    assert data.classes == ("cat", "dog", "emu") and data.num_classes == 3
    assert (len(data.x_train), len(data.x_test)) == (9, 3)  # a fifth of each class of 4: one
    batch = data.x_test[np.arange(3)]
    assert batch.shape == (3, 3, 8, 8) and batch.dtype == np.float32 and 0.0 <= batch.min() and batch.max() <= 1.0
    red = batch[:, 0].mean(axis=(1, 2))
    np.testing.assert_allclose(red, data.y_test * 60 / 255, atol=1e-6)  # each image read with its own label


def test_images_are_centre_cropped_resized_and_greyed_for_the_input(tmp_path):
    from edgert.models.image_folder import read_image

    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, 10:30] = 255  # a white centre square between black bands: the crop keeps only it
    PIL.fromarray(pixels).save(tmp_path / "wide.png")
    grey = read_image(tmp_path / "wide.png", (1, 5, 5))
    assert grey.shape == (1, 5, 5)
    np.testing.assert_allclose(grey, 1.0, atol=1e-6)
    colour = read_image(tmp_path / "wide.png", (3, 4, 8))  # the input's own aspect: all of it
    assert colour.shape == (3, 4, 8) and colour[:, :, 0].max() < 0.1 and colour[:, :, 4].min() > 0.9


def test_train_and_test_folders_give_the_split(tmp_path):
    write_images(tmp_path / "pics" / "train", per_class=3)
    write_images(tmp_path / "pics" / "test", per_class=2, classes=("cat", "emu"))
    data = load_dataset(tmp_path / "pics", sample_shape=(3, 6, 6))
    assert data.classes == ("cat", "dog", "emu")
    assert (len(data.x_train), len(data.x_test)) == (9, 4) and sorted(set(data.y_test.tolist())) == [0, 2]


@pytest.mark.parametrize("make,shape,message", [
    (lambda root: root.mkdir(), (3, 8, 8), "no class folders"),
    (lambda root: (root / "cat").mkdir(parents=True), (3, 8, 8), "class folder(s) cat hold no images"),
    (lambda root: write_images(root), (3, 8), "images need a model input [N, C, H, W]"),
    (lambda root: write_images(root), (2, 8, 8), "C 1 (grey) or 3 (RGB)"),
    (lambda root: write_images(root), None, "no model input was given"),
    (lambda root: None, (3, 8, 8), "data file or folder not found"),
])
def test_bad_image_folders_are_one_line(tmp_path, make, shape, message):
    root = tmp_path / "pics"
    make(root)
    with pytest.raises(DatasetError) as error:
        load_dataset(root, sample_shape=shape)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_unreadable_image_is_named_when_its_row_is_read(tmp_path):
    root = write_images(tmp_path / "pics", per_class=2)
    (root / "dog" / "broken.png").write_bytes(b"not a png")
    data = load_dataset(root, sample_shape=(3, 8, 8))
    with pytest.raises(DatasetError, match="broken.png: not an image Pillow can read"):
        data.x_train[np.arange(len(data.x_train))]
        data.x_test[np.arange(len(data.x_test))]


def test_without_pillow_images_ask_for_it(tmp_path, monkeypatch):
    root = write_images(tmp_path / "pics")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(MissingDependencyError, match="reading images needs Pillow: pip install pillow"):
        load_dataset(root, sample_shape=(3, 8, 8))


# -- a run's data.json ---------------------------------------------------------------------------------

def test_data_settings_make_paths_absolute_and_round_trip(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_csv(tmp_path / "d.csv", np.ones((10, 2), np.float32), ["a", "b"] * 5, label_column="kind")
    settings = DataSettings.given("d.csv", seed=2, label_column="kind")
    assert settings.source == str(tmp_path / "d.csv")
    assert DataSettings.given("digits").source == "digits"
    dataset = settings.load()
    write_data_record(tmp_path, DataRecord.of(settings, dataset))
    record = read_data_record(tmp_path)
    assert record.settings == settings and record.classes == ("a", "b") and record.test_samples == 2
    again = record.settings.load()
    np.testing.assert_array_equal(again.x_test[:], dataset.x_test[:])


def test_a_missing_or_broken_data_json_is_one_line(tmp_path):
    with pytest.raises(DatasetError, match="data.json: missing; a run records its data there"):
        read_data_record(tmp_path)
    (tmp_path / "data.json").write_text(json.dumps({"source": "digits", "seed": "zero"}))
    with pytest.raises(DatasetError, match="data setting 'seed' is 'zero'"):
        read_data_record(tmp_path)
    with pytest.raises(DatasetError, match="run folder not found"):
        read_data_record(tmp_path / "nowhere")


def test_a_csv_written_on_windows_reads_the_same(tmp_path):
    """A byte-order mark and CRLF line ends (a spreadsheet's export) change nothing."""
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfa,b,label\r\n1,2,cat\r\n3,4,dog\r\n5,6,cat\r\n7,8,dog\r\n\r\n")
    data = load_csv(path)
    assert data.classes == ("cat", "dog") and data.sample_shape == (2,)
    rows = np.concatenate([data.x_train[:], data.x_test[:]])
    labels = np.concatenate([data.y_train, data.y_test])
    assert sorted(zip(rows[:, 0].tolist(), labels.tolist())) == [(1.0, 0), (3.0, 1), (5.0, 0), (7.0, 1)]
