"""Errors of the host-side exporter; each names the bad input and what would be legal."""

from edgert.errors import EdgertError


class ExportError(EdgertError):
    """Base of every exporter error."""


class ModelLoadError(ExportError):
    """The file is not an ONNX model, or its graph is invalid, or ORT 1.19 cannot run it."""


class CutError(ExportError):
    """A requested cut does not exist, leaves a stage empty, or asks for more stages than blocks."""


class SliceError(ExportError):
    """A stage cannot be cut out cleanly (e.g. a parameter is used on both sides of a cut)."""


class GradientError(ExportError):
    """ORT's gradient builder cannot differentiate the stage (an op without a gradient)."""


class PortabilityError(ExportError):
    """A stage graph needs an operator that stock onnxruntime lacks and that edgert cannot rewrite."""


class PlanError(ExportError):
    """No placement exists (nothing fits in memory), or the planning problem is malformed."""


class PredictorError(ExportError):
    """Bad input to the latency predictor: unknown device, empty profile, malformed file."""
