"""The checkout stays clean for a newcomer: what the README's commands create is ignored by git."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", [".venv/bin/python", "runs/2026-01-01-1/metrics.jsonl", "plan/manifest.json"])
def test_what_a_newcomer_creates_is_ignored(path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
    assert done.returncode == 0, f"git does not ignore {path}: add it to .gitignore"
