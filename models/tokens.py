"""The majority-marker token task for transformer-mini: a named data set, made from its seed (numpy only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edgert.models.errors import DatasetError
from edgert.models.samples import Dataset, check_seed

if TYPE_CHECKING:
    from edgert.models import ModelSpec


def load(name: str, model_spec: ModelSpec | None, seed: int, sample_shape: tuple[int, ...] | None) -> Dataset:
    """``tokens``: with a zoo model that trains on it, its sequence length, vocabulary and classes."""
    if model_spec is None or model_spec.dataset != "tokens":
        return synthetic_tokens(seed=seed)
    return synthetic_tokens(
        seq_len=model_spec.input_shape[0],
        vocab=model_spec.vocab_size,
        num_classes=model_spec.num_classes,
        seed=seed,
    )


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
    check_seed(seed)
    rng = np.random.default_rng(seed)
    x, y = _majority_marker(n_train + n_test, seq_len, vocab, num_classes, rng)
    return Dataset("tokens", x[:n_train], y[:n_train], x[n_train:], y[n_train:], num_classes)


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
