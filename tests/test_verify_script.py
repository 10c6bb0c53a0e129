"""The README's main job: `python launch/verify.py` starts its own CPU ranks and reports PASS."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "verify.py"


def _run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--cpu", *flags], capture_output=True, text=True, timeout=240)


def test_verify_passes_on_two_cpu_ranks():
    r = _run("--seqlen", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--layout", "stripe")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("PASS") == 11, r.stdout  # 5 rows x (causal, non-causal) + the summary


@pytest.mark.parametrize("flags", [("--seqlen", "63"), ("--backend", "nope")], ids=["indivisible", "bad-backend"])
def test_verify_fails_cleanly_on_bad_input(flags):
    r = _run("--heads", "2", "--head-dim", "8", *flags)
    assert r.returncode != 0
    assert "ValueError" in r.stderr
