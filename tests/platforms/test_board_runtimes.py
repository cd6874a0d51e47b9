"""Board runtimes other than this host's: a real ``edgert worker`` on each trains one stage of an x86 run.

Two boards, each with the board runtime installed the way a board installs it (stock
onnxruntime from the package index, no training build, no onnx, no torch):

- ``aarch64``: a Debian trixie arm64 root (Python 3.13, like Raspberry Pi OS) under QEMU user
  mode (platforms/emulated). Marked ``arm``: the root is built once by
  ``platforms/emulated/arm64-root.sh build`` (minutes); without it these tests are skipped,
  unless ``EDGERT_ARM_REQUIRED=1`` (CI), which makes a missing root a failure.
- ``stock-python``: the virtual environment whose Python ``EDGERT_BOARD_PYTHON`` names (CI
  makes one on CPython 3.10 with ``pip install '.[board]'``); skipped when it is not set.
"""

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.exporter.export import ExportOptions, export_plan
from edgert.manifest import TrainingConfig
from edgert.models import build_model, save_model
from edgert.weights import load_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

SCRIPT = Path(__file__).resolve().parents[2] / "platforms" / "emulated" / "arm64-root.sh"
STAGES, BOARD_STAGE, STEPS = 3, 1, 20
PROBE_BOARD = ("import platform, sys, onnxruntime, edgert.worker.worker\n"
               "print(platform.machine(), sys.version.split()[0], onnxruntime.__version__)\n"
               "import importlib.util as u; print(u.find_spec('onnx'), u.find_spec('torch'))\n"
               "print('onnxruntime.training' in sys.modules)")


def _script(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@dataclass
class Board:
    """How to run the board's Python, and where the board sees a folder of this host."""

    name: str
    python: list[str]
    shared: Path  # a folder of this host the board can read
    shared_inside: str  # the same folder as the board names it

    def run(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([*self.python, *args], capture_output=True, text=True, timeout=timeout, cwd="/")


def _aarch64_board() -> Board:
    if os.geteuid() != 0 or "built: no" in _script("status", timeout=60).stdout:
        reason = "no emulated aarch64 root: run platforms/emulated/arm64-root.sh build (as root)"
        if os.environ.get("EDGERT_ARM_REQUIRED") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    started = time.monotonic()
    installed = _script("install")
    assert installed.returncode == 0, installed.stderr
    print(f"board runtime installed in {time.monotonic() - started:.0f} s: {installed.stderr.strip()}")
    root = Path(next(line.split(": ", 1)[1] for line in _script("status", timeout=60).stdout.splitlines()
                     if line.startswith("root: ")))
    return Board("aarch64", [str(SCRIPT), "run", "/opt/edgert/bin/python"], root / "srv", "/srv")


def _stock_python_board(shared: Path) -> Board:
    python = os.environ.get("EDGERT_BOARD_PYTHON")
    if not python:
        pytest.skip("EDGERT_BOARD_PYTHON is not set (a Python with pip install '.[board]', no training build)")
    return Board("stock-python", [python], shared, str(shared))


@pytest.fixture(scope="module", params=[pytest.param("aarch64", marks=pytest.mark.arm), "stock-python"])
def board(request, tmp_path_factory):
    """A board with this checkout's board runtime; the aarch64 root's mounts are released afterwards."""
    if request.param == "aarch64":
        board = _aarch64_board()
    else:
        board = _stock_python_board(tmp_path_factory.mktemp("board-shared"))
    probe = board.run("-c", PROBE_BOARD, timeout=300)
    assert probe.returncode == 0, probe.stderr
    machine, python, ort_version, onnx_spec, torch_spec, training_imported = probe.stdout.split()
    assert (onnx_spec, torch_spec, training_imported) == ("None", "None", "False")
    if board.name == "aarch64":
        assert machine == "aarch64" and python.startswith("3.13")
    print(f"board {board.name}: {machine}, Python {python}, onnxruntime {ort_version}")
    yield board
    if board.name == "aarch64":
        _script("unmount", timeout=60)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arm-plan")
    save_model(build_model("mlp"), folder / "mlp.onnx")
    export_plan(folder / "mlp.onnx", folder / "plan",
                ExportOptions(stages=STAGES, training=TrainingConfig(learning_rate=3e-3)))
    return folder / "plan"


class BoardWorker:
    """``edgert worker`` run by the board's Python, on a free loopback port of this machine."""

    def __init__(self, board: Board, log: Path):
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            [*board.python, "-m", "edgert", "worker", "--insecure", "--name", board.name,
             "--listen", "coap+tcp://127.0.0.1:0"], stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd="/")

    def url(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line and self.process.poll() is not None:
                raise AssertionError(f"the board's worker exited with {self.process.returncode}")
            match = re.search(r"listening on (\S+)", line)
            if match:
                return match.group(1)
        raise AssertionError("the board's worker did not start listening in time")

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=60)
        finally:
            self.log.close()


def _train(plan: Path, workers: list[str], out: Path):
    config = TrainConfig(plan_dir=plan, workers=tuple(workers), out_dir=out, listen="coap+tcp://127.0.0.1:0",
                         progress=False, data="digits", schedule="gpipe", steps=STEPS, micro_batches=2,
                         batch_size=32)
    return train(config)


def _parameters(run: Path) -> dict[str, np.ndarray]:
    values = {}
    for k in range(STAGES):
        values.update(load_state(run / "checkpoints" / "latest" / f"stage{k}.cbor").parameters)
    return values


def test_a_board_worker_trains_a_stage_like_x86(board, plan, tmp_path):
    log = tmp_path / f"{board.name}-worker.log"
    worker = BoardWorker(board, log)
    try:
        board_url = worker.url()
        with LocalCluster(STAGES - 1, log_dir=tmp_path / "logs") as x86:
            workers = list(x86.urls)
            workers.insert(BOARD_STAGE, board_url)
            started = time.monotonic()
            mixed = _train(plan, workers, tmp_path / "mixed")
            mixed_seconds = time.monotonic() - started
            started = time.monotonic()
            with LocalCluster(1, log_dir=tmp_path / "logs-extra") as third:
                reference = _train(plan, [*x86.urls[:BOARD_STAGE], third.urls[0], *x86.urls[BOARD_STAGE:]],
                                   tmp_path / "x86")
            x86_seconds = time.monotonic() - started
    finally:
        assert worker.stop() == 0, log.read_text()[-2000:]
    assert mixed.steps == reference.steps == STEPS
    got, expected = _parameters(tmp_path / "mixed"), _parameters(tmp_path / "x86")
    assert got.keys() == expected.keys()
    worst = max(float(np.max(np.abs(got[n] - expected[n]))) / max(float(np.max(np.abs(expected[n]))), 1e-3)
                for n in expected)
    print(f"{board.name}: {STEPS} gpipe steps with stage {BOARD_STAGE} on the board in {mixed_seconds:.1f} s "
          f"(all on this host: {x86_seconds:.1f} s); largest relative parameter difference {worst:.2e}")
    assert worst <= 1e-5, f"largest relative parameter difference {worst:.2e}"


CHAIN_PROBE = """
import json, sys
import numpy as np
from edgert.chain import StageChain
out = {}
for plan in sys.argv[1:]:
    chain = StageChain(plan, memory_mode="stash")
    manifest = chain.manifest
    rng = np.random.default_rng(0)
    x = {t.name: (rng.integers(0, 4, t.shape_for(8)) if t.dtype == "int64" else rng.standard_normal(t.shape_for(8)))
         .astype(t.dtype) for t in manifest.model_input}
    y = {t.name: rng.integers(0, 2, t.shape_for(8)).astype(t.dtype) for t in manifest.labels}
    losses = []
    for _ in range(2):
        losses.append(chain.train_batch(x, y, micro_batches=2).loss)
        gradients = chain.gradients()
        chain.step()
    out[plan] = {"losses": losses, "gradients": {k: v.tolist() for k, v in gradients.items()}}
out["training_build_imported"] = "onnxruntime.training" in sys.modules
print(json.dumps(out))
"""


def test_every_zoo_model_trains_on_the_board_as_on_this_host(board, tmp_path):
    """Every zoo model's portable stages (3 stages, activation stashing) give this host's numbers on the board."""
    import json
    import shutil
    import sys

    from edgert.models import list_models

    shared = board.shared / "zoo-plans"
    shutil.rmtree(shared, ignore_errors=True)
    names = [spec.name for spec in list_models()]
    for name in names:
        save_model(build_model(name), tmp_path / f"{name}.onnx")
        export_plan(tmp_path / f"{name}.onnx", shared / name, ExportOptions(stages=3))
    inside = [f"{board.shared_inside}/zoo-plans/{name}" for name in names]
    on_board = board.run("-c", CHAIN_PROBE, *inside, timeout=900)
    assert on_board.returncode == 0, on_board.stderr[-3000:]
    here = subprocess.run([sys.executable, "-c", CHAIN_PROBE, *[str(shared / n) for n in names]],
                          capture_output=True, text=True, timeout=600)
    assert here.returncode == 0, here.stderr[-3000:]
    board_results, host_results = json.loads(on_board.stdout), json.loads(here.stdout)
    assert board_results["training_build_imported"] is False
    for name, path_inside in zip(names, inside):
        got, expected = board_results[path_inside], host_results[str(shared / name)]
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5, err_msg=name)
        # relative to the model's largest gradient, as edgert check does: a gradient that is exactly zero in
        # theory (a bias before BatchNorm) holds rounding noise that is meaningless relative to itself
        gradients = {k: np.asarray(v) for k, v in expected["gradients"].items()}
        scale = max(float(np.max(np.abs(v), initial=0.0)) for v in gradients.values())
        worst = max(float(np.max(np.abs(np.asarray(got["gradients"][k]) - v), initial=0.0))
                    for k, v in gradients.items())
        assert worst / scale <= 1e-5, f"{name}: largest gradient difference {worst / scale:.2e} of the largest"
    shutil.rmtree(shared, ignore_errors=True)


def test_a_board_evaluates_and_predicts_like_this_host(board):
    """``edgert evaluate`` and ``edgert predict`` on the board (stock onnxruntime, no onnx, no scikit-learn): the
    figures this host computes, for a model with class names and data of its own."""
    import json
    import shutil
    import sys

    shared = board.shared / "use-result"
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir(parents=True)
    model = build_model("mlp", seed=1)
    model.metadata_props.add(key="edgert.classes", value=json.dumps([f"c{k}" for k in range(10)]))
    save_model(model, shared / "mlp.onnx")
    rng = np.random.default_rng(0)
    np.savez(shared / "data.npz", x=rng.random((50, 64), np.float32), y=rng.integers(0, 10, 50))
    np.save(shared / "rows.npy", rng.random((3, 64), np.float32))
    results = {}
    for where, python, folder in (("board", board.python, board.shared_inside + "/use-result"),
                                  ("host", [sys.executable], str(shared))):
        commands = (["evaluate", f"{folder}/mlp.onnx", "--data", f"{folder}/data.npz", "--json"],
                    ["predict", f"{folder}/mlp.onnx", f"{folder}/rows.npy", "--json"])
        outputs = []
        for command in commands:
            done = subprocess.run([*python, "-m", "edgert", *command], capture_output=True, text=True, timeout=600,
                                  cwd="/")
            assert done.returncode == 0, f"{where}: {done.stderr[-2000:]}"
            outputs.append([json.loads(line) for line in done.stdout.splitlines()])
        results[where] = outputs
    (board_scores, board_top), (host_scores, host_top) = results["board"], results["host"]
    assert board_scores[0]["samples"] == host_scores[0]["samples"] == 10
    assert board_scores[0]["accuracy"] == host_scores[0]["accuracy"]
    assert board_scores[0]["loss"] == pytest.approx(host_scores[0]["loss"], rel=1e-5)
    assert [[t["name"] for t in line["top"]] for line in board_top] == [[t["name"] for t in line["top"]]
                                                                        for line in host_top]
    np.testing.assert_allclose([[t["probability"] for t in line["top"]] for line in board_top],
                               [[t["probability"] for t in line["top"]] for line in host_top], rtol=1e-5)
    shutil.rmtree(shared, ignore_errors=True)
