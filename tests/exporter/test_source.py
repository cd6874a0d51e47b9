"""Loading source models: garbage, invalid graphs, and IR versions newer than ORT 1.19 reads."""

import onnx
import pytest

from edgert.exporter.errors import ModelLoadError
from edgert.exporter.source import load_source_model
from tests.conftest import make_skip_model


def test_file_that_is_not_onnx(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is a text file, not a protobuf\n" * 10)
    with pytest.raises(ModelLoadError, match="not an ONNX model"):
        load_source_model(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_source_model(tmp_path / "absent.onnx")


def test_invalid_graph_names_the_problem(tmp_path):
    model = make_skip_model()
    model.graph.node[1].input[0] = "does_not_exist"
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ModelLoadError, match="invalid ONNX graph.*does_not_exist"):
        load_source_model(path)


def test_newer_ir_version_is_lowered_when_the_opset_allows(tmp_path):
    model = make_skip_model()
    model.ir_version = 11
    path = tmp_path / "ir11.onnx"
    path.write_bytes(model.SerializeToString())
    source = load_source_model(path)
    assert source.model.ir_version == 8
    assert any("lowered IR version 11 -> 8" in note for note in source.notes)


def test_newer_ir_version_with_too_new_opset_says_why(tmp_path):
    model = make_skip_model(opset=22)
    model.ir_version = 11
    path = tmp_path / "ir11_opset22.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelLoadError, match="opset 22 is newer than ONNX Runtime 1.19 supports"):
        load_source_model(path)


def test_custom_op_domain_is_refused(tmp_path):
    model = make_skip_model()
    model.graph.node[1].domain = "evil.ops"
    model.opset_import.append(onnx.helper.make_opsetid("evil.ops", 1))
    path = tmp_path / "custom.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelLoadError, match="op domain 'evil.ops'"):
        load_source_model(path)
