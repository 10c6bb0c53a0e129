"""The README's usage snippet runs as written and its checks print PASS (a user copies it first)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _usage_snippet() -> str:
    text = README.read_text()
    usage = text[text.index("## Usage"):]
    return re.search(r"```python\n(.*?)```", usage, re.S).group(1)


def test_readme_usage_snippet_runs_and_passes():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_usage_snippet(), str(README), "exec"), {})
    lines = printed.getvalue().splitlines()
    verdicts = [line for line in lines if line.rstrip().endswith(("PASS", "FAIL"))]
    assert verdicts and all(line.rstrip().endswith("PASS") for line in verdicts), printed.getvalue()
