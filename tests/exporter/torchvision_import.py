"""Import torchvision beside torch's CPU wheel, whose matching torchvision wheel may be a CUDA build.

torchvision 0.28.0 (the release for torch 2.13.0) ships one wheel on the package index, built against
CUDA: its native library ``_C.so`` needs ``libtorch_cuda.so``, which torch's CPU wheel lacks, so it does
not load. torchvision then imports without its native operators, except that ``_meta_registrations``
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally, and that fails
with ``operator torchvision::nms does not exist``. Declaring those two schemas first (no kernel: detection
models would fail at the call, classification models never call them) lets ``torchvision.models`` build.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

# The operators torchvision registers fake kernels for whether or not its native library loaded.
_UNCONDITIONAL_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_declared = []  # the torch.library.Library that holds the declared schemas must stay alive


def import_torchvision() -> ModuleType:
    """``import torchvision``, declaring the native operators' schemas first when its native library cannot load."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        raise ImportError("torchvision is not installed (pip install -e '.[torch]')")
    if not _declared and not _native_library_loads(spec) and not hasattr(torch.ops.torchvision, "nms"):
        library = torch.library.Library("torchvision", "DEF")
        for schema in _UNCONDITIONAL_SCHEMAS:
            library.define(schema)
        _declared.append(library)
    import torchvision

    return torchvision


def _native_library_loads(spec: importlib.machinery.ModuleSpec) -> bool:
    import torch

    for folder in spec.submodule_search_locations or ():
        for library in sorted(Path(folder).glob("_C*.so")) + sorted(Path(folder).glob("_C*.pyd")):
            try:
                torch.ops.load_library(str(library))
                return True
            except (OSError, RuntimeError):
                return False
    return False
