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


def one_epoch_run(folder, model, stages: int):
    """``model`` cut into ``stages`` and trained for one epoch on as many real worker processes: its run folder."""
    save_model(model, folder / "model.onnx")
    export_plan(folder / "model.onnx", folder / "plan", ExportOptions(stages=stages))
    with LocalCluster(stages, log_dir=folder / "logs") as cluster:
        train(TrainConfig(plan_dir=folder / "plan", workers=tuple(cluster.urls), out_dir=folder / "run", epochs=1,
                          listen="coap+tcp://127.0.0.1:0", progress=False))
    return folder / "run"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A real 3-stage run of the zoo's mlp on three real worker processes: one epoch, one checkpoint."""
    return one_epoch_run(tmp_path_factory.mktemp("merge"), build_model("mlp"), 3)


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


# -- the merged model is ready to serve: deterministic, BatchNorm on the run's statistics ------------

def with_training_dropout(model, ratio=0.3):
    """``model`` with a Dropout in training mode after every Relu, as a training-mode torch export writes it:
    ratio and mode as initializers in half of them, as Constant nodes in the others; one keeps its mask output."""
    import onnx
    from onnx import TensorProto, helper

    graph = model.graph
    nodes, renamed = [], {}
    relus = [n for n in graph.node if n.op_type == "Relu"]
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        nodes.append(node)
        if node.op_type != "Relu":
            continue
        k = relus.index(node)
        block = node.name.split("/")[1]
        ratio_name, mode_name = f"{block}.dropout.ratio", f"{block}.dropout.training_mode"
        if k % 2 == 0:
            graph.initializer.extend([helper.make_tensor(ratio_name, TensorProto.FLOAT, [], [ratio]),
                                      helper.make_tensor(mode_name, TensorProto.BOOL, [], [True])])
        else:
            nodes += [helper.make_node("Constant", [], [ratio_name], name=f"/{block}/dropout/Constant",
                                       value=helper.make_tensor("v", TensorProto.FLOAT, [], [ratio])),
                      helper.make_node("Constant", [], [mode_name], name=f"/{block}/dropout/Constant_1",
                                       value=helper.make_tensor("v", TensorProto.BOOL, [], [True]))]
        output = f"/{block}/Dropout_output_0"
        outputs = [output, f"/{block}/Dropout_output_1"] if k == 0 else [output]
        nodes.append(helper.make_node("Dropout", [node.output[0], ratio_name, mode_name], outputs,
                                      name=f"/{block}/Dropout"))
        renamed[node.output[0]] = output
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def dropout_run(tmp_path_factory):
    """A real 2-stage run of the zoo's cnn (BatchNorm) with four training-mode Dropouts: one epoch."""
    return one_epoch_run(tmp_path_factory.mktemp("merge-dropout"), with_training_dropout(build_model("cnn")), 2)


def logits_of(path, x):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_a_merged_model_gives_the_same_output_for_the_same_input(dropout_run, tmp_path):
    import onnx

    source = onnx.load(str(dropout_run / "plan" / "source.onnx"))
    assert sum(n.op_type == "Dropout" for n in source.graph.node) == 4
    result = merge_cli(dropout_run, tmp_path / "m.onnx")
    assert result.exit_code == 0, result.output
    assert "inference form: 4 Dropout removed, 3 BatchNormalization on running statistics" in result.output
    merged = onnx.load(str(tmp_path / "m.onnx"))
    assert not [n for n in merged.graph.node if n.op_type in ("Dropout", "Constant")]
    assert not [i.name for i in merged.graph.initializer if "dropout" in i.name]  # ratio and mode went with them
    x = load_dataset("digits-image").x_test
    first, again = logits_of(tmp_path / "m.onnx", x), logits_of(tmp_path / "m.onnx", x)
    assert np.array_equal(first, again)
    from edgert.chain import StageChain
    from edgert.weights import load_state

    chain = StageChain(dropout_run.parent / "plan")  # the plan trained; the run keeps its manifest and source
    for k, stage in enumerate(chain.stages):
        stage.load_parameters(load_state(dropout_run / "checkpoints" / "latest" / f"stage{k}.cbor").parameters)
    np.testing.assert_allclose(first, chain.infer({"input": x}), rtol=1e-5, atol=1e-5)


def test_batchnorm_runs_on_the_run_s_running_statistics(dropout_run, tmp_path):
    import onnx
    from onnx import numpy_helper

    from edgert.weights import load_state

    assert merge_cli(dropout_run, tmp_path / "m.onnx").exit_code == 0
    merged = onnx.load(str(tmp_path / "m.onnx")).graph
    batchnorms = [n for n in merged.node if n.op_type == "BatchNormalization"]
    assert len(batchnorms) == 3
    assert all(len(n.output) == 1 and all(a.i == 0 for a in n.attribute if a.name == "training_mode")
               for n in batchnorms)
    trained = {}
    for k in range(2):
        trained.update(load_state(dropout_run / "checkpoints" / "latest" / f"stage{k}.cbor").parameters)
    values = {i.name: numpy_helper.to_array(i) for i in merged.initializer}
    for node in batchnorms:
        for stat, initial in ((node.input[3], 0.0), (node.input[4], 1.0)):
            np.testing.assert_array_equal(values[stat], trained[stat])
            assert np.abs(values[stat] - initial).max() > 1e-3  # moved from its initial value by training


def test_the_merged_model_scores_the_run_s_last_evaluation(dropout_run, tmp_path):
    """`edgert evaluate` on the merged model, with the data the merge recorded: the run's figures, as numbers."""
    import json

    assert merge_cli(dropout_run, tmp_path / "m.onnx").exit_code == 0
    result = CliRunner().invoke(main, ["evaluate", str(tmp_path / "m.onnx"), "--json"])
    assert result.exit_code == 0, result.output
    scored = json.loads(result.output.strip().splitlines()[-1])
    evaluated = [m for m in read_metrics(dropout_run) if m["type"] == "eval"][-1]
    assert scored["samples"] == 359 and scored["split"] == "test"
    assert scored["accuracy"] == pytest.approx(evaluated["test_accuracy"], abs=1e-12)
    assert scored["loss"] == pytest.approx(evaluated["test_loss"], rel=1e-5)


def test_the_training_form_keeps_the_source_s_dropout_and_batchnorm(dropout_run, tmp_path):
    import onnx

    result = CliRunner().invoke(main, ["merge", str(dropout_run), "-o", str(tmp_path / "t.onnx"), "--training-form"])
    assert result.exit_code == 0 and "training form kept" in result.output, result.output
    merged = onnx.load(str(tmp_path / "t.onnx"))
    source = onnx.load(str(dropout_run / "plan" / "source.onnx"))
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in source.graph.node]
    assert {p.key: p.value for p in merged.metadata_props}["edgert.form"] == "training"
    # each Dropout as exported, its ratio and training_mode inputs included (whether an onnxruntime then draws masks
    # in an inference session is its own choice: 1.19 does, 1.32 drops them)
    kept = [list(n.input) for n in merged.graph.node if n.op_type == "Dropout"]
    assert kept and kept == [list(n.input) for n in source.graph.node if n.op_type == "Dropout"]


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning", "ignore:Converting a tensor")
def test_a_transformer_exported_in_training_mode_merges_deterministic(tmp_path):
    """The issue's case: torch's TransformerEncoder in training mode writes 8 Dropouts; merged, none is left."""
    torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch==2.13.0)")
    import onnx

    from edgert.chain import StageChain
    from edgert.exporter.merge import merge_run
    from edgert.weights import StageState, save_state

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 16)
            layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)).mean(1))

    torch.manual_seed(0)
    module = Encoder().train()
    path = tmp_path / "encoder.onnx"
    torch.onnx.export(module, (torch.randint(0, 16, (2, 8)),), str(path), dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      input_names=["tokens"], output_names=["logits"],
                      dynamic_axes={"tokens": {0: "N"}, "logits": {0: "N"}}, opset_version=17)
    assert sum(n.op_type == "Dropout" for n in onnx.load(str(path)).graph.node) == 8
    plan = tmp_path / "run" / "plan"
    manifest = export_plan(path, plan, ExportOptions(stages=2))
    chain = StageChain(plan)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 16, (32, 8))
    labels = {manifest.labels[0].name: rng.integers(0, 4, (32,))}
    for _ in range(2):
        chain.train_batch({"tokens": tokens}, labels)
        chain.step()
    latest = tmp_path / "run" / "checkpoints" / "latest"
    for k, stage in enumerate(chain.stages):
        save_state(StageState(parameters=stage.parameters(), step=1, stage=k), latest / f"stage{k}.cbor")
    (latest / "checkpoint.json").write_text('{"step": 1, "epoch": 0, "stages": 2}')
    result = merge_run(tmp_path / "run", tmp_path / "merged.onnx")
    assert result.inference.dropouts == 8
    first, again = logits_of(tmp_path / "merged.onnx", tokens), logits_of(tmp_path / "merged.onnx", tokens)
    assert np.array_equal(first, again)
    np.testing.assert_allclose(first, chain.infer({"tokens": tokens}), rtol=1e-5, atol=1e-5)
