"""Workers SIGTERMed in the middle of a run over coaps+tcp exit 0 and log no error (issue 15, C5).

Every worker stops at once, so each one's sends to the others fail while it shuts down:
that is no stage failure, and no send task may be left to fail after the loop is gone
("Task exception was never retrieved ... NetworkError").
"""

import signal
import threading
import time

import pytest

from edgert.coordinator.coordinator import TrainConfig, train
from edgert.coordinator.localcluster import LocalCluster
from edgert.coordinator.runlog import read_metrics
from edgert.errors import EdgertError
from edgert.exporter.export import ExportOptions, export_plan
from edgert.models import build_model, save_model
from edgert.security.keystore import local_cluster_keys

pytestmark = pytest.mark.timeout(180)
NAMES = ["w0", "w1"]
SIGNS_OF_TROUBLE = ("never retrieved", "Traceback", "Exception in thread", "ERROR")


def test_sigterm_mid_run_exits_0_with_a_clean_log(tmp_path):
    save_model(build_model("mlp"), tmp_path / "mlp.onnx")
    export_plan(tmp_path / "mlp.onnx", tmp_path / "plan", ExportOptions(stages=2))
    credentials = local_cluster_keys(tmp_path / "keys", NAMES)
    out, logs = tmp_path / "run", tmp_path / "logs"
    cluster = LocalCluster(2, names=NAMES, credentials=credentials, log_dir=logs, slowdowns=["3", "3"])
    with cluster:
        config = TrainConfig(plan_dir=tmp_path / "plan", workers=tuple(cluster.urls), out_dir=out, steps=5000,
                             epochs=1000, listen="coaps+tcp://127.0.0.1:0", keys=tmp_path / "keys" / "cluster",
                             progress=False, replicate_every=2, central_every=3)
        ended = threading.Event()

        def go():
            try:
                train(config)
            except EdgertError:
                pass  # every worker is gone: the run fails, which is not what this test is about
            finally:
                ended.set()

        threading.Thread(target=go, daemon=True).start()
        deadline = time.monotonic() + 60
        while not [m for m in _metrics(out) if m["type"] == "step" and m["step"] >= 5]:
            assert time.monotonic() < deadline and not ended.is_set(), "training did not get going"
            time.sleep(0.05)
        for process in cluster.processes:
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(30) for process in cluster.processes]
        assert ended.wait(120)
    assert codes == [0, 0]
    for name in NAMES:
        text = (logs / f"{name}.log").read_text()
        assert not [sign for sign in SIGNS_OF_TROUBLE if sign in text], text[-3000:]


def _metrics(out):
    try:
        return read_metrics(out)
    except (OSError, ValueError):
        return []
