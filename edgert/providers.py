"""Which onnxruntime execution providers a worker's sessions use (``edgert worker --providers``).

The default is the CPU. A board with an accelerator names its provider first (``cuda,cpu``
on a Jetson with onnxruntime-gpu); the CPU provider always comes last, for the operators
the accelerator lacks. A provider the installed onnxruntime does not offer is an error
that lists the ones it does.
"""

from __future__ import annotations

from edgert.errors import ProviderError
from edgert.ort_import import onnxruntime

CPU = "CPUExecutionProvider"
DEFAULT_PROVIDERS: tuple[str, ...] = (CPU,)
ALIASES = {
    "cpu": CPU, "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider", "acl": "ACLExecutionProvider", "armnn": "ArmNNExecutionProvider",
    "openvino": "OpenVINOExecutionProvider", "coreml": "CoreMLExecutionProvider", "qnn": "QNNExecutionProvider",
}


def parse_providers(text: str) -> tuple[str, ...]:
    """``"cuda,cpu"`` -> ``("CUDAExecutionProvider", "CPUExecutionProvider")``; full names pass as they are."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ProviderError("--providers is empty; name at least one, e.g. cpu or cuda,cpu")
    chosen = [ALIASES.get(name.lower(), name) for name in names]
    unknown = [n for n, full in zip(names, chosen) if not full.endswith("ExecutionProvider")]
    if unknown:
        raise ProviderError(f"unknown execution provider(s) {', '.join(unknown)}: use one of "
                            f"{', '.join(sorted(ALIASES))} or a full name such as CUDAExecutionProvider")
    ordered = list(dict.fromkeys(p for p in chosen if p != CPU))
    return (*ordered, CPU)


def check_available(providers: tuple[str, ...]) -> tuple[str, ...]:
    """``providers`` when the installed onnxruntime offers each of them, else a :class:`ProviderError`."""
    available = onnxruntime().get_available_providers()
    missing = [p for p in providers if p not in available]
    if missing:
        raise ProviderError(f"this onnxruntime ({onnxruntime().__version__}) does not offer "
                            f"{', '.join(missing)}; it offers {', '.join(available)}")
    return providers


def confirm_loaded(session, requested: tuple[str, ...], what: str) -> None:
    """Refuse a session that dropped a requested provider.

    onnxruntime lists a provider as available even when its libraries (CUDA, cuDNN) cannot
    be loaded, and then falls back to the CPU with a warning edgert's logging hides.
    """
    dropped = [p for p in requested if p not in session.get_providers()]
    if dropped:
        raise ProviderError(f"{what}: onnxruntime could not load {', '.join(dropped)} (its libraries are missing "
                            f"or do not match this onnxruntime) and would run on the CPU; fix that, or start the "
                            f"worker with --providers cpu")
