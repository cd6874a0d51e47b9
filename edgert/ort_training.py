"""The one place that imports ONNX Runtime's training API, without importing torch.

``import onnxruntime.training`` pulls in torch through its ``optim`` package. A board has
no torch, so ``onnxruntime.training`` is registered as a bare package (keeping its
``__path__``) before its ``api`` and ``onnxblock`` submodules are imported.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

from edgert.errors import MissingDependencyError

_PACKAGE = "onnxruntime.training"


def _register_bare_package() -> None:
    if _PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "onnxruntime-training is not installed: pip install onnxruntime-training-cpu==1.19.2 "
            "(x86-64) or build ORT with --enable_training_apis (see platforms/)"
        )
    package = types.ModuleType(_PACKAGE)
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules[_PACKAGE] = package


def quiet_logging() -> None:
    """Keep ORT's informational graph-transformer logs off the console."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)


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
    quiet_logging()
    return importlib.import_module(f"{_PACKAGE}.api")


def onnxblock() -> Any:
    """``onnxruntime.training.onnxblock`` (host only: it imports onnx)."""
    _register_bare_package()
    quiet_logging()
    return importlib.import_module(f"{_PACKAGE}.onnxblock")


def training_graph_utils() -> Any:
    """ORT's helpers that build gradient-accumulation graphs (host only)."""
    _register_bare_package()
    return importlib.import_module(f"{_PACKAGE}.onnxblock._training_graph_utils")


def gradient_builder() -> tuple[Any, Any]:
    """ORT's C++ ``GradientGraphBuilder`` and ``get_optimized_model`` bindings (host only)."""
    _register_bare_package()
    from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

    return GradientGraphBuilder, get_optimized_model
