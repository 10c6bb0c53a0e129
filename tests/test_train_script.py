"""`launch/train.py` under torchrun on CPU gloo ranks: the ring's loss per step equals a single-process
run's (transformers' own sdpa attention on the whole sequence) to 1e-6 in float32, and both curves are
plotted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tqdm")

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "train.py"


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_train_ring_loss_equals_single_process(world, tmp_path):
    torchrun = shutil.which("torchrun") or ""
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--standalone", f"--nproc_per_node={world}", str(SCRIPT), "--steps", "20", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "warn" not in r.stderr.lower(), r.stderr[-3000:]  # a normal run prints no warning
    record = json.loads((tmp_path / f"train-W{world}-fp32.json").read_text())
    ring, single = record["losses"]["ring"], record["losses"]["single"]
    assert len(ring) == len(single) == 20
    assert max(abs(a - b) for a, b in zip(ring, single)) <= 1e-6
    assert ring[-1] < ring[0]  # it learns
    if record.get("png"):
        assert Path(record["png"]).stat().st_size > 0
