"""The plan manifest: JSON round trip, and refusal of plans whose files were altered."""

import json

import pytest

from edgert.errors import ManifestError
from edgert.exporter.export import ExportOptions, export_plan
from edgert.manifest import FORMAT_VERSION, Manifest, load_manifest


@pytest.fixture
def plan(skip_model_path, tmp_path):
    export_plan(skip_model_path, tmp_path / "plan", ExportOptions(cuts=("c", "d")))
    return tmp_path / "plan"


def test_round_trip_is_lossless(plan):
    manifest = load_manifest(plan)
    again = Manifest.from_json(json.loads(json.dumps(manifest.to_json())))
    assert again == manifest
    assert again.format_version == FORMAT_VERSION
    assert again.cuts == ("c", "d")
    stage = again.stages[1]
    assert [t.name for t in stage.inputs] == ["a_out", "b_out"]  # the skip crosses this cut
    assert stage.inputs[0].shape == ("N", 6) and stage.inputs[0].dtype == "float32"
    assert {a.role for a in stage.artifacts} == {"backward", "forward_stash", "backward_stash", "eval", "infer",
                                                 "parameters", "backward_input", "backward_weight",
                                                 "backward_stash_input", "backward_stash_weight"}
    # stage 0's backward reads its Relu's output; stage 1's Gemm and Add need nothing of their forward but the inputs
    assert again.stages[0].saved and not stage.saved and not again.stages[-1].saved
    assert all(len(a.sha256) == 64 for a in stage.artifacts)
    assert again.stages[-1].labels[0].name == "labels"


def test_tampered_artifact_is_refused(plan):
    manifest = load_manifest(plan)
    target = plan / manifest.stages[1].artifact("backward").path
    target.write_bytes(target.read_bytes() + b"\x00")
    with pytest.raises(ManifestError, match="stage 1 backward: backward.onnx does not match the manifest"):
        load_manifest(plan)


def test_missing_artifact_is_refused(plan):
    manifest = load_manifest(plan)
    (plan / manifest.stages[0].artifact("parameters").path).unlink()
    with pytest.raises(ManifestError, match="stage 0 parameters: file .* is missing"):
        load_manifest(plan)


def test_unknown_format_version_and_garbage(plan, tmp_path):
    data = json.loads((plan / "manifest.json").read_text())
    data["format_version"] = 99
    (plan / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="format version 99 is not supported"):
        load_manifest(plan)
    data["format_version"] = 1
    (plan / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="exported by an older edgert .* export it again"):
        load_manifest(plan)
    (plan / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(plan)
    with pytest.raises(ManifestError, match="no manifest.json"):
        load_manifest(tmp_path / "elsewhere")
