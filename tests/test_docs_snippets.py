"""Every ```python block of the README and of docs/*.md runs as written, on the CPU.

A block runs in a fresh namespace in this process. A block whose previous line is `<!-- ring: W=N -->`
is a script for every rank of a ring (what `torchrun --nproc_per_node=N` starts): it runs on N spawned
gloo ranks, whose process group the harness has already made, so the block's own
`init_process_group` / `destroy_process_group` calls are left to the harness. Printed lines that end in
PASS or FAIL (`ringlse.testing.judge`) must all be PASS. Shell blocks are not run."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from dist_harness import run_ranks

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:<!-- ring: W=(\d+) -->\n)?```python\n(.*?)```", re.S)


def snippets() -> list:
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start(2)) + 1
            world = int(m.group(1)) if m.group(1) else 0
            out.append(pytest.param(str(path.relative_to(REPO)), line, world, m.group(2),
                                    id=f"{path.relative_to(REPO)}:{line}"))
    return out


def _run(code: str, where: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    lines = printed.getvalue().splitlines()
    verdicts = [line for line in lines if line.rstrip().endswith(("PASS", "FAIL"))]
    assert all(line.rstrip().endswith("PASS") for line in verdicts), printed.getvalue()
    return printed.getvalue()


def ring_snippet(rank: int, world: int, code: str, where: str) -> str:
    """One rank of a ring block: the group exists already (the harness's), as torchrun's env does."""
    import torch.distributed as dist

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *args, **kwargs: None
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        return _run(code, where)
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy


def test_every_doc_has_been_read():
    assert (REPO / "docs").is_dir() and len(DOCS) > 1
    assert snippets(), "no python blocks found"


@pytest.mark.parametrize("doc, line, world, code", snippets())
def test_snippet_runs(doc, line, world, code, tmp_path):
    where = f"{doc}:{line}"
    if world:
        run_ranks(ring_snippet, world, tmp_path, code, where, timeout=180)
    else:
        _run(code, where)


def test_generated_results_are_current():
    """docs/results.md and the README's headline table are what benchmarks/report.py makes of
    benchmarks/results/ (it runs on a CPU and writes nothing with --check)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "report.py"), "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_benchmarks_keep_what_a_user_runs():
    """benchmarks/ holds runnable benchmarks, not probes or A/B scripts; results/ the newest of each."""
    bench = REPO / "benchmarks"
    assert not [p.name for p in bench.glob("*.py") if "_probe" in p.name or "_ab" in p.name]
    assert len(list((bench / "results").iterdir())) <= 44
    assert not (bench / "NOTES.md").exists()
