"""The one way edgert imports onnxruntime: stock or training build, never torch, never both at once.

Boards and hosts run stock ``onnxruntime``. The training build (``onnxruntime-training-cpu``,
the ``reference`` extra: a test oracle) installs the same ``onnxruntime`` module and, when
imported, validates itself by importing ``onnxruntime.training.ortmodule`` and with it
torch. So for a training build ``onnxruntime.training`` is first registered as a bare
package (keeping its ``__path__``) with ``ortmodule`` marked absent; a stock build is
imported as it is. Two distributions that both provide the module overwrite each other's
files; that is refused with the commands that repair it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

from edgert.errors import MissingDependencyError

TRAINING_PACKAGE = "onnxruntime.training"
BOARD_INSTALL = "pip install 'edgert[board]'"
HOST_INSTALL = "pip install 'edgert[host]'"
REFERENCE_INSTALL = "pip install 'edgert[reference]'"


def onnxruntime() -> Any:
    """The ``onnxruntime`` module, checked and imported as described above (cheap after the first call)."""
    if "onnxruntime" not in sys.modules:
        _check_one_distribution()
        training = training_folder()
        if training is not None:
            register_training_package(training)
    import onnxruntime as module

    module.set_default_logger_severity(3)
    return module


def training_folder() -> Path | None:
    """The training build's ``onnxruntime/training`` folder, or None for a stock build (or none at all)."""
    spec = importlib.util.find_spec("onnxruntime")  # a top-level spec: the package is not executed
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        return None
    training = Path(locations[0]) / "training"
    return training if (training / "api").is_dir() else None


def register_training_package(training: Path) -> None:
    """Register ``onnxruntime.training`` as a bare package, so importing onnxruntime skips torch."""
    if TRAINING_PACKAGE in sys.modules:
        return
    package = types.ModuleType(TRAINING_PACKAGE)
    package.__path__ = [str(training)]
    package.__package__ = TRAINING_PACKAGE
    sys.modules[TRAINING_PACKAGE] = package
    sys.modules.setdefault(f"{TRAINING_PACKAGE}.ortmodule", None)


def _check_one_distribution() -> None:
    providers = sorted(set(importlib.metadata.packages_distributions().get("onnxruntime", [])))
    if not providers:
        raise MissingDependencyError(f"onnxruntime is not installed: {BOARD_INSTALL} on a board, "
                                     f"{HOST_INSTALL} on the host")
    if len(providers) > 1:
        raise MissingDependencyError(
            f"{' and '.join(providers)} are all installed and overwrite each other's onnxruntime module; "
            f"pip uninstall -y {' '.join(providers)}, then {BOARD_INSTALL} (a board) or {HOST_INSTALL} (the host)")
