"""Packaging: `kernels/` installs as `ringlse.kernels` and never as a top-level `kernels` (which would
clash with an unrelated PyPI package), in the wheel and in the editable install; and `import ringlse`
works without Triton."""

from __future__ import annotations

import json

import pytest
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env_without_repo_on_path() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def _run_python(code: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=_env_without_repo_on_path(), capture_output=True, text=True,
        timeout=timeout,
    )


def test_wheel_has_ringlse_kernels_and_no_top_level_kernels(tmp_path):
    # build from a copy so that setuptools' build/ and *.egg-info never land in the working tree
    src = tmp_path / "src"
    shutil.copytree(
        REPO, src,
        ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", ".whl", "results"
        ),
    )
    wheel_dir = tmp_path / "wheels"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), "-q"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    elapsed = time.perf_counter() - t0
    print(f"pip wheel took {elapsed:.1f} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(wheel_dir.glob("ringlse-*.whl"))
    assert len(wheels) == 1, list(wheel_dir.iterdir())
    with zipfile.ZipFile(wheels[0]) as zf:
        names = zf.namelist()
        top_level = next((zf.read(n).decode() for n in names if n.endswith(".dist-info/top_level.txt")), "")
    assert "ringlse/__init__.py" in names
    assert "ringlse/kernels/__init__.py" in names
    assert not [n for n in names if n.startswith("kernels/")], names
    assert "kernels" not in top_level.split(), top_level
    # every kernel module of the repository ships inside ringlse.kernels
    for py in (REPO / "kernels").glob("*.py"):
        assert f"ringlse/kernels/{py.name}" in names, py.name


def test_editable_install_maps_kernels_under_ringlse(tmp_path):
    # run from tmp_path without PYTHONPATH: the repository root is not on sys.path, so only the
    # installation decides what `ringlse.kernels` and `kernels` resolve to
    code = """
import importlib.util, json, sys
import ringlse, ringlse.kernels
spec = importlib.util.find_spec("kernels")
top = None
if spec is not None:
    top = spec.origin or ";".join(spec.submodule_search_locations or [])
print(json.dumps({"ringlse": ringlse.__file__, "kernels": ringlse.kernels.__file__, "top": top, "path": sys.path}))
"""
    proc = _run_python(code, tmp_path)
    assert proc.returncode == 0, (
        "ringlse is not installed: run `pip install -e . --no-build-isolation --no-deps`\n" + proc.stderr
    )
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(REPO) not in info["path"]  # ("" is the cwd, tmp_path)
    assert Path(info["ringlse"]).resolve() == REPO / "ringlse" / "__init__.py", (
        f"ringlse imports from {info['ringlse']}, not from this checkout {REPO}: reinstall it editable here"
    )
    assert Path(info["kernels"]).resolve() == REPO / "kernels" / "__init__.py"
    # a top-level `kernels` may exist (an unrelated package), but never one from this repository
    assert info["top"] is None or str(REPO) not in info["top"], info["top"]


_NO_TRITON_PRELUDE = """
import sys
sys.path.insert(0, {repo!r})

class _NoTriton:
    # a meta-path finder that makes every `import triton...` fail, as on a machine without it
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoTriton())
"""


def test_import_and_attention_without_triton(tmp_path):
    code = _NO_TRITON_PRELUDE.format(repo=str(REPO)) + """
import torch
import ringlse
from ringlse.reference import reference_attention

g = torch.Generator().manual_seed(0)
q = torch.randn(1, 97, 4, 80, dtype=torch.float64, generator=g)
k = torch.randn(1, 97, 2, 80, dtype=torch.float64, generator=g)
v = torch.randn(1, 97, 2, 80, dtype=torch.float64, generator=g)
out = ringlse.attention(q, k, v, causal=True)
ref, _ = reference_attention(q, k, v, causal=True)
torch.testing.assert_close(out, ref)
o1, l1 = ringlse.block_attention(q, k[:, :40], v[:, :40], causal=True, backend="auto")
o2, l2 = ringlse.block_attention(q, k[:, 40:], v[:, 40:], causal=True, k_start=40, backend="auto")
out2, _ = ringlse.merge_attn_states([o1, o2], [l1, l2])
torch.testing.assert_close(out2, ref)
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
assert not loaded, loaded
print("ok", ringlse.__file__)
"""
    proc = _run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok"), proc.stdout
    assert str(REPO) in proc.stdout  # the checkout under test, not some other installation


def test_backends_report_triton_missing(tmp_path):
    # `sys.modules["triton"] = None` is how Python spells "not installed" to importlib.util.find_spec
    code = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
sys.modules["triton"] = None
import ringlse
assert ringlse.available_backends("cpu") == ["torch"], ringlse.available_backends("cpu")
try:
    ringlse.get_block_op("triton", "cpu")
except ValueError as e:
    assert "triton is not installed" in str(e), e
else:
    raise AssertionError("get_block_op('triton') should fail without triton")
print("ok")
"""
    proc = _run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "ok"


def test_every_package_directory_is_installed():
    """A wheel installs only the packages pyproject lists: every directory with an __init__.py under
    ringlse/ and kernels/ must be there (kernels/ as ringlse.kernels)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("ringlse", "ringlse"), ("kernels", "ringlse.kernels")):
        for init in (root / top).rglob("__init__.py"):
            rel = init.parent.relative_to(root / top).parts
            found.add(".".join((name, *rel)))
    assert found == listed, f"pyproject packages {sorted(listed)} vs package directories {sorted(found)}"
