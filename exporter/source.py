"""Loading a source model: parse, validate, and bring it within what ORT 1.19 can train.

ORT 1.19 loads IR versions up to 10 and the ai.onnx opset up to 21. A model written by a
newer exporter is lowered when its opsets allow it; otherwise the error says why not.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from edgert.exporter.errors import ModelLoadError

MAX_IR_VERSION = 10
MAX_AI_ONNX_OPSET = 21
MIN_AI_ONNX_OPSET = 13
# The IR version each ai.onnx opset first needs (onnx.helper.VERSION_TABLE, ORT 1.19's range).
_IR_FOR_OPSET = {13: 7, 14: 7, 15: 8, 16: 8, 17: 8, 18: 8, 19: 9, 20: 9, 21: 10}
_KNOWN_DOMAINS = {"", "ai.onnx", "com.microsoft"}
SOURCE_FILE = "source.onnx"  # a plan's copy of the model it was cut from
_PROTOBUF_LIMIT = 2**31  # one serialized protobuf message


@dataclass(frozen=True)
class SourceModel:
    """A validated model ready for normalisation, with the hash of the file it came from."""

    model: onnx.ModelProto
    sha256: str
    path: str
    notes: tuple[str, ...] = ()


def load_source_model(path: str | Path) -> SourceModel:
    """Read an ONNX file (with its external data file, where its tensors live in one), check it, and lower its IR
    version when ORT 1.19 needs that.

    A model whose tensors lie in an external file (torch's default exporter writes ``MODEL.onnx.data``) is read
    whole; its hash is that of the whole model in one file, as a plan keeps it (``source.onnx``).
    """
    path = Path(path)
    data = _read(path)
    model = _parse(data, path)
    if _external_data_load(model, path):
        source = _prepare(model, "", str(path))
        return dataclasses.replace(source, sha256=hashlib.sha256(source.model.SerializeToString()).hexdigest())
    return _prepare(model, hashlib.sha256(data).hexdigest(), str(path))


def load_plan_source(plan_dir: str | Path, source_sha256: str) -> SourceModel:
    """A plan folder's copy of its source model, refused unless it is the file the plan was cut from."""
    path = Path(plan_dir) / SOURCE_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing; the plan keeps the model it was cut from there (export the plan again)")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != source_sha256:
        raise ModelLoadError(f"{path} is damaged or replaced: its sha256 {digest[:12]}... is not the manifest's "
                             f"source_sha256 {source_sha256[:12]}...; put back the model the plan was cut from, "
                             "or export the plan again")
    return _prepare(_parse(data, path), digest, str(path))


def from_model_proto(model: onnx.ModelProto, name: str = "<in-memory>") -> SourceModel:
    """The same checks as :func:`load_source_model`, for a model already in memory."""
    data = model.SerializeToString()
    return _prepare(_parse(data, Path(name)), hashlib.sha256(data).hexdigest(), name)


def _prepare(model: onnx.ModelProto, sha256: str, name: str) -> SourceModel:
    notes = _lower_ir_version(model, name)
    _check_opsets(model, name)
    _check_graph(model, name)
    return SourceModel(model=model, sha256=sha256, path=name, notes=tuple(notes))


def _read(path: Path) -> bytes:
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, expected an .onnx file")
    return path.read_bytes()


def _parse(data: bytes, path: Path) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as error:
        raise ModelLoadError(f"{path}: not an ONNX model ({error})") from None
    if not model.HasField("graph") or not model.graph.node:
        raise ModelLoadError(f"{path}: not an ONNX model (no graph with nodes found)")
    return model


def _external_data_load(model: onnx.ModelProto, path: Path) -> bool:
    """Read the tensors ``model`` keeps in external files beside ``path``; False when it keeps none there."""
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    if not any(uses_external_data(tensor) for tensor in model.graph.initializer):
        return False
    try:
        load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as error:
        raise ModelLoadError(f"{path}: its tensors are stored in an external data file that cannot be read "
                             f"({error}); keep the .onnx and its data file together") from None
    if model.ByteSize() >= _PROTOBUF_LIMIT:
        raise ModelLoadError(f"{path}: {model.ByteSize() / 2**30:.1f} GiB with its tensors; edgert takes models "
                             "under 2 GiB (one protobuf)")
    return True


def _ai_onnx_opset(model: onnx.ModelProto) -> int | None:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    return None


def _lower_ir_version(model: onnx.ModelProto, name: str) -> list[str]:
    if model.ir_version <= MAX_IR_VERSION:
        return []
    opset = _ai_onnx_opset(model)
    if opset is None or opset > MAX_AI_ONNX_OPSET:
        raise ModelLoadError(
            f"{name}: IR version {model.ir_version} with ai.onnx opset {opset} is newer than "
            f"ONNX Runtime 1.19 supports (IR <= {MAX_IR_VERSION}, opset <= {MAX_AI_ONNX_OPSET}); "
            f"re-export with opset_version <= {MAX_AI_ONNX_OPSET}"
        )
    target = _IR_FOR_OPSET.get(opset, MAX_IR_VERSION)
    old = model.ir_version
    model.ir_version = target
    return [f"lowered IR version {old} -> {target} (opset {opset} allows it)"]


def _check_opsets(model: onnx.ModelProto, name: str) -> None:
    opset = _ai_onnx_opset(model)
    if opset is None:
        raise ModelLoadError(f"{name}: the model imports no ai.onnx opset")
    if not MIN_AI_ONNX_OPSET <= opset <= MAX_AI_ONNX_OPSET:
        raise ModelLoadError(
            f"{name}: ai.onnx opset {opset} is outside what edgert trains "
            f"({MIN_AI_ONNX_OPSET}..{MAX_AI_ONNX_OPSET}); re-export with opset_version=17 (torch.onnx.export)"
        )
    for node in model.graph.node:
        if node.domain not in _KNOWN_DOMAINS:
            raise ModelLoadError(
                f"{name}: node {node.name or node.op_type!r} uses op domain {node.domain!r}; "
                f"only the standard ai.onnx and com.microsoft domains can be trained"
            )
    if model.functions:
        raise ModelLoadError(
            f"{name}: the model defines local functions ({', '.join(f.name for f in model.functions)}); "
            "inline them first (onnx.inliner.inline_local_functions)"
        )


def _check_graph(model: onnx.ModelProto, name: str) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as error:
        first = str(error).strip().splitlines()[0]
        raise ModelLoadError(f"{name}: invalid ONNX graph: {first}") from None
