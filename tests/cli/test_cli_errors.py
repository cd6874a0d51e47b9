"""Bad input to the ``edgert`` command gets one ``error:`` line naming the problem and a non-zero exit, never a
traceback (README: "bad input gets a clear error"). Every case runs the real command in its own process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from edgert.cli import _Group
from edgert.coordinator.localcluster import LocalCluster
from edgert.devices import BlockTiming, DeviceProfile, DevicesFile, LinkProfile, save_devices
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.planner.replanner import Replanner
from edgert.manifest import load_manifest
from edgert.security.keystore import local_cluster_keys
from tests.zoo_plans import zoo_plan

INSECURE_WARNING = "WARNING: --insecure"


def edgert(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "edgert", *map(str, args)], capture_output=True, text=True,
                          timeout=180, cwd=cwd, env=env)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str, progress: bool = False) -> str:
    """Exit code != 0, no traceback, and stderr is one ``error:`` line (besides --insecure's warning, and the
    progress lines before it of a command that reports progress)."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith(INSECURE_WARNING)]
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert len(lines) == 1 or progress, result.stderr
    assert sum("error" in line.lower() for line in lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The zoo mlp and its 2-stage plan."""
    folder = tmp_path_factory.mktemp("cli")
    zoo_plan(folder, 2)
    return folder


# -- where a worker or the coordinator listens, and which workers it reaches --------------------------------------

def test_a_worker_on_a_port_in_use_says_so():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        result = edgert("worker", "--insecure", "--listen", f"coap+tcp://127.0.0.1:{port}")
    finally:
        taken.close()
    assert_one_line_error(result, f"cannot listen on coap+tcp://127.0.0.1:{port}", "in use")


def test_a_worker_on_an_address_of_another_host_says_so():
    result = edgert("worker", "--insecure", "--listen", "coap+tcp://192.0.2.1:0")  # TEST-NET-1: never this host's
    assert_one_line_error(result, "cannot listen on coap+tcp://192.0.2.1:0", "address")


@pytest.mark.parametrize("command", ["worker", "train"])
def test_a_listen_port_out_of_range_is_refused(folder, command):
    credential = local_cluster_keys(folder / f"keys-{command}", ["w0"], cluster="cli")[0]
    args = (["worker", "--credential", credential] if command == "worker"
            else ["train", folder / "plan", "--workers", "coaps+tcp://127.0.0.1:5701", "--keys",
                  folder / f"keys-{command}" / "cluster"])
    result = edgert(*args, "--listen", "coaps+tcp://127.0.0.1:99999")
    assert_one_line_error(result, "--listen", "coaps+tcp://127.0.0.1:99999", "invalid port")


@pytest.mark.parametrize("workers,message", [
    ("127.0.0.1:5701", "has no scheme: write coaps+tcp://127.0.0.1:5701"),
    ("coap+tcp://127.0.0.1:5701,http://127.0.0.1:5702", "scheme must be one of coap+tcp, coaps+tcp, coap"),
])
def test_worker_urls_without_a_coap_scheme_are_refused(folder, tmp_path, workers, message):
    result = edgert("train", folder / "plan", "--insecure", "--workers", workers, "--out", tmp_path / "run")
    assert_one_line_error(result, "--workers", message)
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def tls_worker(tmp_path_factory):
    keys = tmp_path_factory.mktemp("tls-keys")
    credentials = local_cluster_keys(keys, ["local-0"], cluster="cli")
    with LocalCluster(1, credentials=credentials) as cluster:
        yield cluster.urls[0]


def test_plaintext_to_a_tls_worker_says_it_speaks_tls(folder, tmp_path, tls_worker):
    plaintext = tls_worker.replace("coaps+tcp://", "coap+tcp://")
    result = edgert("train", folder / "plan", "--insecure", "--workers", f"{plaintext},{plaintext}",
                    "--steps", "1", "--out", tmp_path / "run")
    assert_one_line_error(result, "speaks TLS", f"reach it at {tls_worker}")


# -- codecs: the command line parses them as the worker does -------------------------------------------------------

@pytest.fixture(scope="module")
def workers():
    with LocalCluster(2) as cluster:
        yield ",".join(cluster.urls)


def train(folder: Path, workers: str, out: Path, *options: str) -> Path:
    """A real 4-step run of the 2-stage mlp on ``workers``: its run folder."""
    result = edgert("train", folder / "plan", "--insecure", "--workers", workers, "--steps", "4", *options,
                    "--out", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def run_folder(folder, workers, tmp_path_factory) -> Path:
    return train(folder, workers, tmp_path_factory.mktemp("runs") / "run")


def test_codecs_spelt_as_the_help_shows_them_train(folder, workers, tmp_path):
    out = train(folder, workers, tmp_path / "run", "--grad-codec", "topk:0.1", "--codec", "int8:1")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if m["type"] == "step"] == [0, 1, 2, 3]
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["forward_codec"], config["backward_codec"]) == ("int8:axis=1", "topk:ratio=0.1")


@pytest.mark.parametrize("option,spec,message", [
    ("--grad-codec", "topk:2", "ratio must be in (0, 1]"),
    ("--grad-codec", "topk:often", "must be key=value or a number (topk:ratio=N)"),
    ("--codec", "zip", "unknown codec 'zip'"),
])
def test_a_bad_codec_is_refused_before_training(folder, tmp_path, option, spec, message):
    result = edgert("train", folder / "plan", "--insecure", "--workers", "coap+tcp://127.0.0.1:9,coap+tcp://127.0.0.1:9",
                    option, spec, "--out", tmp_path / "run")
    assert_one_line_error(result, option, message)


# -- files edgert writes or reads ----------------------------------------------------------------------------------

def test_export_into_a_folder_that_cannot_be_made(folder):
    line = assert_one_line_error(edgert("export", folder / "mlp.onnx", "--stages", "2", "-o", "/proc/nope/"),
                                 "/proc/nope: cannot write a plan there", "No such file or directory", progress=True)
    assert ".building-" not in line, line  # the folder the user gave, not the scratch folder export builds in


@pytest.fixture
def run_copy(run_folder, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_folder, copy, ignore=shutil.ignore_patterns("profile", "stage-cache"))
    return copy


def test_a_checkpoint_json_with_a_bad_step_is_named(run_copy, tmp_path):
    index = run_copy / "checkpoints" / "latest" / "checkpoint.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "step": "x"}))
    assert_one_line_error(edgert("merge", run_copy, "-o", tmp_path / "m.onnx"),
                          str(index), "step: expected an integer, got 'x'")


def test_a_damaged_stage_checkpoint_is_named(run_copy, tmp_path):
    stage = run_copy / "checkpoints" / "latest" / "stage1.cbor"
    stage.write_bytes(b"\xc2\x41\x00" + stage.read_bytes()[3:])  # CBOR tag 2 where the envelope starts
    line = assert_one_line_error(edgert("merge", run_copy, "-o", tmp_path / "m.onnx"), str(stage), "damaged")
    assert "4.00" not in line and "Bad Request" not in line


def test_demo_refuses_a_wrong_slowdowns_count_before_writing_anything(tmp_path):
    assert_one_line_error(edgert("demo", "--stages", "2", "--slowdowns", "1,2,3", "--out", tmp_path / "demo"),
                          "--slowdowns gives 3 values for 2 stages")
    assert not (tmp_path / "demo").exists()  # no model built, no plan exported first


# -- devices.json, checked field by field --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def devices_json(folder, tmp_path_factory) -> dict:
    """A devices file that plans the mlp: two profiled devices and their links."""
    scratch = tmp_path_factory.mktemp("devices")
    export_plan(folder / "mlp.onnx", scratch / "whole", ExportOptions(stages=1))
    replanner = Replanner(scratch / "whole", load_manifest(scratch / "whole"), scratch / "cache", micro_batches=4)
    units = tuple("+".join(b.name for b in replanner.analysis.blocks[a:e]) for a, e in replanner._units)

    def device(name: str, slowness: float) -> DeviceProfile:
        return DeviceProfile(name=name, url=f"coap+tcp://127.0.0.1:{5700 + len(name)}", memory_bytes=1 << 30,
                             cores=2, blocks=tuple(BlockTiming(unit, 0.1 * slowness, 0.3 * slowness, optimizer_ms=0.01)
                                                   for unit in units))

    devices = DevicesFile(model_sha256=replanner.source.sha256, blocks=units, micro_batch=16,
                          devices=(device("pi-1", 1.0), device("pi-22", 1.5)),
                          links=(LinkProfile("pi-1", "pi-22", 1e7, 1.0), LinkProfile("pi-22", "pi-1", 1e7, 1.0)))
    path = save_devices(devices, scratch / "devices.json")
    assert edgert("plan", folder / "mlp.onnx", "--devices", path, "-o", scratch / "planned").returncode == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("change,message", [
    (lambda d: d["devices"][0]["blocks"][0].update(forward_ms="fast"),
     "devices[0].blocks[0].forward_ms: expected a number, got 'fast'"),
    (lambda d: d["links"][0].update(bandwidth_bytes_per_s="fast"),
     "links[0].bandwidth_bytes_per_s: expected a number, got 'fast'"),
    (lambda d: d["devices"][1].update(memory_bytes=None), "devices[1].memory_bytes: expected an integer, got null"),
    (lambda d: d["devices"][0].update(name=7), "devices[0].name: expected a string, got 7"),
    (lambda d: d.update(micro_batch=0), "micro_batch must be >= 1, got 0"),
    (lambda d: d.update(micro_batch="16"), "micro_batch: expected an integer, got '16'"),
], ids=["forward_ms", "bandwidth", "memory_bytes", "name", "micro_batch_0", "micro_batch_string"])
def test_a_bad_devices_file_is_refused_naming_the_field(folder, devices_json, tmp_path, change, message):
    data = json.loads(json.dumps(devices_json))
    change(data)
    path = tmp_path / "devices.json"
    path.write_text(json.dumps(data))
    result = edgert("plan", folder / "mlp.onnx", "--devices", path, "-o", tmp_path / "planned")
    assert_one_line_error(result, f"{path}: {message}")
    assert not (tmp_path / "planned").exists()


# -- the boundary itself ---------------------------------------------------------------------------------------------

def test_a_bug_still_shows_its_traceback():
    @click.group(cls=_Group)
    def group() -> None:
        pass

    @group.command()
    def broken() -> None:
        raise KeyError("a bug")

    result = CliRunner().invoke(group, ["broken"])
    assert isinstance(result.exception, KeyError)  # not turned into an error line: it reaches the top
