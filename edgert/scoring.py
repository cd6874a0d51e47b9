"""Loss and accuracy of a model's predictions, summed batch by batch: every evaluation's one definition.

The coordinator scores a run's states on the test set after each epoch (``metrics.jsonl``
``eval``); ``edgert evaluate`` scores a merged model on the same split. Both add up
:class:`Score` over batches, so a test set of any size is scored in the memory of one batch,
and both give the same figures for the same predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LOSSES = ("cross_entropy", "mse")  # the losses a plan trains with (exporter/loss.py) and a score knows

@dataclass
class Score:
    """Sums over the samples scored so far: the loss, the correct predictions (classification)."""

    loss: str
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0  # rows of predictions: samples (or, for a prediction per position, positions)
    values: int = 0  # loss terms: rows for cross-entropy, every predicted value for mse

    def add(self, prediction: np.ndarray, labels: np.ndarray) -> None:
        """Score one batch: ``prediction`` the model's output, ``labels`` the targets."""
        if self.loss == "cross_entropy":
            logits = prediction.reshape(-1, prediction.shape[-1]).astype(np.float64)
            target = labels.reshape(-1)
            shifted = logits - logits.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            self.loss_sum += float(-log_probs[np.arange(len(target)), target].sum())
            self.correct += int(np.sum(logits.argmax(axis=1) == target))
            self.samples += len(target)
            self.values += len(target)
        else:
            error = prediction.astype(np.float64) - labels
            self.loss_sum += float(np.sum(error ** 2))
            self.samples += len(prediction)
            self.values += error.size

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.values, 1)

    @property
    def accuracy(self) -> float | None:
        """The share of correct predictions (classification); ``None`` for a regression loss."""
        return self.correct / max(self.samples, 1) if self.loss == "cross_entropy" else None

