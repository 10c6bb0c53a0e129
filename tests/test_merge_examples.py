"""The examples in docs/split-kv.md and docs/prefix-cache.md run as written (on CPU) and check
themselves against full attention (`torch.testing.assert_close` inside each snippet)."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("name", ["split-kv.md", "prefix-cache.md"])
def test_doc_example_runs_and_equals_full_attention(name):
    blocks = python_blocks(DOCS / name)
    assert len(blocks) == 1, f"{name}: expected one python block, found {len(blocks)}"
    code = blocks[0]
    assert "assert_close" in code and "ringlse.attention" in code, "the example must check itself"
    exec(compile(code, str(DOCS / name), "exec"), {"__name__": f"docs_{name}"})
