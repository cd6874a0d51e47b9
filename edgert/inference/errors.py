"""Errors of evaluating and predicting with a trained model: one line naming the model, the file or the mismatch."""

from edgert.errors import EdgertError


class InferenceError(EdgertError):
    """A model that cannot be loaded, or inputs it cannot take (wrong shape, wrong type, labels out of range)."""
