"""A board has no onnx (and no torch): the runtime must import and start without them."""

import subprocess
import sys

BLOCKER = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('onnx', 'torch', 'sklearn'):
            raise ImportError(f'{name} is not installed on this board')
sys.meta_path.insert(0, _Block())
"""


def run_without_host_packages(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, timeout=120)


def test_runtime_imports_without_onnx_or_torch():
    result = run_without_host_packages(
        "import edgert, edgert.manifest, edgert.stage, edgert.chain, edgert.optimizer, edgert.cli\n"
        "assert 'onnx' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "print('ok')"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_host_command_without_host_extra_says_what_to_install():
    result = run_without_host_packages(
        "import sys\nfrom edgert.cli import main\nsys.argv = ['edgert', 'export', 'model.onnx', '-o', 'plan']\nmain()"
    )
    assert result.returncode == 2
    assert "needs the host extra: pip install 'edgert[host]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_board_trains_a_stage_without_onnx(tmp_path):
    import onnx

    from edgert.exporter.export import ExportOptions, export_plan
    from tests.conftest import make_skip_model

    onnx.save(make_skip_model(), str(tmp_path / "m.onnx"))
    export_plan(tmp_path / "m.onnx", tmp_path / "plan", ExportOptions(stages=2))
    result = run_without_host_packages(
        "import numpy as np\n"
        "from edgert.chain import StageChain\n"
        f"chain = StageChain({str(tmp_path / 'plan')!r})\n"
        "x = np.ones((4, 4), np.float32); y = np.zeros(4, np.int64)\n"
        "first = chain.train_batch({'input': x}, {'labels': y}).loss; chain.step()\n"
        "second = chain.train_batch({'input': x}, {'labels': y}).loss\n"
        "assert second < first, (first, second)\n"
        "assert 'onnx' not in sys.modules\n"
        "print('trained')"
    )
    assert result.returncode == 0, result.stderr
    assert "trained" in result.stdout
