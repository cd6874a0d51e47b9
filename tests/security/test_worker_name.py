"""``edgert worker`` takes its name from its credential and refuses a ``--name`` that contradicts it."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def run_worker(*args: str, wait: float = 30.0) -> tuple[int | None, str, str]:
    """Start a worker; stop it after its first line (or ``wait`` s). Returns (exit code or None, stdout, stderr)."""
    process = subprocess.Popen([sys.executable, "-m", "edgert", "worker", "--listen", "coaps+tcp://127.0.0.1:0",
                                *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = process.stdout.readline()  # "" once it exited without a line
    code = process.wait(wait) if not first else None
    process.terminate()
    out, err = process.communicate(timeout=wait)
    return code, first + out, err


def test_the_name_defaults_to_the_credentials(cluster):
    code, out, err = run_worker("--credential", str(cluster.workers[1]))
    assert out.startswith("edgert worker w1 listening on coaps+tcp://127.0.0.1:"), out + err


def test_the_matching_name_is_accepted(cluster):
    code, out, err = run_worker("--credential", str(cluster.workers[1]), "--name", "w1")
    assert out.startswith("edgert worker w1 listening on"), out + err


def test_a_name_that_contradicts_the_credential_is_refused_in_one_line(cluster):
    code, out, err = run_worker("--credential", str(cluster.workers[1]), "--name", "w2")
    assert code not in (None, 0) and out == "", out + err
    assert err.strip().splitlines() == [
        f"error: --name w2 does not match the name in {cluster.workers[1].name} ('w1'); "
        "leave --name out to use the credential's"]
