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
from pathlib import Path
from typing import Any

from edgert.errors import MissingDependencyError

_PACKAGE = "onnxruntime.training"


def _register_bare_package() -> None:
    """Register ``onnxruntime.training`` as a bare package before ``onnxruntime`` is imported.

    Importing ``onnxruntime`` validates its build by importing ``onnxruntime.training.ortmodule``,
    which imports torch (seconds, and not on a board). Marking ``ortmodule`` absent makes that
    validation skip it; nothing in edgert uses ORTModule.
    """
    if _PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec("onnxruntime")  # a top-level spec: the package is not executed
    locations = spec.submodule_search_locations if spec is not None else None
    training = Path(locations[0]) / "training" if locations else None
    if training is None or not (training / "api").is_dir():
        raise MissingDependencyError(
            "onnxruntime with training support is not installed: pip install onnxruntime-training-cpu==1.19.2 "
            "(x86-64) or build ORT with --enable_training_apis (see platforms/)"
        )
    package = types.ModuleType(_PACKAGE)
    package.__path__ = [str(training)]
    package.__package__ = _PACKAGE
    sys.modules[_PACKAGE] = package
    sys.modules.setdefault(f"{_PACKAGE}.ortmodule", None)


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
