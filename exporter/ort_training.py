"""The one place that imports ONNX Runtime's training API (the gradient oracle only), without importing torch.

edgert builds its own gradients; the training build (the ``reference`` extra: x86-64, CPython
3.11/3.12, its last release) serves only as a second opinion (exporter/training_build.py).
``import onnxruntime.training`` pulls in torch through its ``optim`` package, so the package is
registered bare (edgert.ort_import) before its ``api`` and ``onnxblock`` submodules are imported.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from edgert.errors import MissingDependencyError
from edgert.ort_import import (
    REFERENCE_INSTALL,
    TRAINING_PACKAGE,
    onnxruntime,
    register_training_package,
    training_folder,
)

if TYPE_CHECKING:
    import onnx


def _register_bare_package() -> None:
    """Make ``onnxruntime.training`` importable without torch, or say how to get the training build."""
    training = training_folder()
    if training is None:
        raise MissingDependencyError(
            "this compares with the ONNX Runtime training build, which training does not need: install it in an "
            f"environment of its own without stock onnxruntime (x86-64, Python 3.11/3.12): {REFERENCE_INSTALL}"
        )
    onnxruntime()  # also keeps ORT's informational logs off the console
    register_training_package(training)  # onnxruntime may have been imported directly, unregistered


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Silence ORT's C++ logging for calls that accept no session options (file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def training_api() -> Any:
    """``onnxruntime.training.api`` (Module, CheckpointState, Optimizer), torch-free."""
    _register_bare_package()
    return importlib.import_module(f"{TRAINING_PACKAGE}.api")


def onnxblock() -> Any:
    """``onnxruntime.training.onnxblock`` (host only: it imports onnx)."""
    _register_bare_package()
    return importlib.import_module(f"{TRAINING_PACKAGE}.onnxblock")


def training_graph_utils() -> Any:
    """ORT's helpers that build gradient-accumulation graphs (host only)."""
    _register_bare_package()
    return importlib.import_module(f"{TRAINING_PACKAGE}.onnxblock._training_graph_utils")


def gradient_graph(model: onnx.ModelProto, loss: str, requires_grad: set[str]) -> onnx.ModelProto:
    """ORT's gradient graph of ``loss`` with respect to ``requires_grad``, after the graph optimizations the
    training build runs first (host only; ORT's RuntimeError where it cannot build one)."""
    _register_bare_package()  # first: it keeps onnxruntime from importing torch
    import onnx  # here only: the training API itself is importable without onnx
    from onnxruntime import SessionOptions
    from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

    options = SessionOptions()
    options.log_severity_level = 3
    optimized = get_optimized_model(model.SerializeToString(), requires_grad, options)
    builder = GradientGraphBuilder(optimized, {loss}, requires_grad, loss, options)
    builder.build()
    return onnx.load_from_string(builder.get_model())
