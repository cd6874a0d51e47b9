"""``edgert merge``: a run's trained stages back into one model, and every stage file checked first."""

import shutil

import numpy as np
import onnxruntime
import pytest
from click.testing import CliRunner

from edgert.cli import main
from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.exporter.export import ExportOptions, export_plan
from edgert.manifest import load_manifest
from edgert.models import build_model, load_dataset, save_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A real 3-stage run of the zoo's mlp on three real worker processes: one epoch, one checkpoint."""
    folder = tmp_path_factory.mktemp("merge")
    save_model(build_model("mlp"), folder / "mlp.onnx")
    export_plan(folder / "mlp.onnx", folder / "plan", ExportOptions(stages=3))
    with LocalCluster(3, log_dir=folder / "logs") as cluster:
        train(TrainConfig(plan_dir=folder / "plan", workers=tuple(cluster.urls), out_dir=folder / "run", epochs=1,
                          listen="coap+tcp://127.0.0.1:0", progress=False))
    return folder / "run"


def copy_run(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def merge_cli(run, out):
    result = CliRunner().invoke(main, ["merge", str(run), "-o", str(out)])
    assert "Traceback" not in result.output
    return result


def test_merge_writes_the_trained_model(trained_run, tmp_path):
    result = merge_cli(trained_run, tmp_path / "m.onnx")
    assert result.exit_code == 0, result.output
    manifest = load_manifest(trained_run / "plan", verify=False)
    assert f"{sum(len(s.parameters) for s in manifest.stages)} trained tensors" in result.output
    data = load_dataset("digits")
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run(None, {manifest.model_input[0].name: data.x_test})[0]
    evaluated = [m for m in read_metrics(trained_run) if m["type"] == "eval"][-1]["test_accuracy"]
    assert float(np.mean(logits.argmax(1) == data.y_test)) == pytest.approx(evaluated)


def test_swapped_stage_files_are_refused_naming_the_file(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path)
    latest = run / "checkpoints" / "latest"
    (latest / "stage0.cbor").rename(latest / "swap")
    (latest / "stage2.cbor").rename(latest / "stage0.cbor")
    (latest / "swap").rename(latest / "stage2.cbor")
    result = merge_cli(run, tmp_path / "m.onnx")
    assert result.exit_code == 2
    assert result.output.strip() == (f"error: {latest / 'stage0.cbor'}: holds stage 2's tensors, not stage 0's "
                                     "(stage files swapped or copied from another run?)")
    assert not (tmp_path / "m.onnx").exists()


def test_a_stage_file_copied_over_another_is_refused(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path)
    latest = run / "checkpoints" / "latest"
    shutil.copyfile(latest / "stage1.cbor", latest / "stage2.cbor")
    result = merge_cli(run, tmp_path / "m.onnx")
    assert result.exit_code == 2 and "stage2.cbor: holds stage 1's tensors, not stage 2's" in result.output
    assert not (tmp_path / "m.onnx").exists()


def test_a_stage_file_of_another_model_is_refused(trained_run, tmp_path):
    """Same names, other shapes: the manifest's shapes are checked too."""
    from edgert.weights import StageState, load_state, save_state

    run = copy_run(trained_run, tmp_path)
    path = run / "checkpoints" / "latest" / "stage1.cbor"
    state = load_state(path)
    name = sorted(state.parameters)[0]
    state.parameters[name] = np.zeros((3, 3), np.float32)
    save_state(StageState(parameters=state.parameters, step=state.step, stage=1), path)
    result = merge_cli(run, tmp_path / "m.onnx")
    assert result.exit_code == 2
    assert f"{path}: {name} has shape [3, 3], but stage 1 of the plan has" in result.output


def test_merge_on_a_plan_folder_says_it_wants_a_run_folder(trained_run, tmp_path):
    result = merge_cli(trained_run / "plan", tmp_path / "m.onnx")
    assert result.exit_code == 2
    assert "is a plan folder; merge takes a run folder" in result.output
    assert "plan/plan" not in result.output


def test_a_damaged_source_model_is_named(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path)
    source = run / "plan" / "source.onnx"
    data = bytearray(source.read_bytes())
    data[-20] ^= 0x20
    source.write_bytes(bytes(data))
    result = merge_cli(run, tmp_path / "m.onnx")
    assert result.exit_code == 2
    assert f"{source} is damaged or replaced" in result.output and "source_sha256" in result.output


def test_an_output_that_cannot_be_written_is_one_line(trained_run):
    result = merge_cli(trained_run, "/proc/x/m.onnx")
    assert result.exit_code == 2
    assert result.output.strip() == "error: /proc/x/m.onnx: no folder /proc/x to write the merged model in"
    result = merge_cli(trained_run, "/proc/m.onnx")  # the folder exists; the file cannot be made
    assert result.exit_code == 2 and "cannot write the merged model" in result.output
