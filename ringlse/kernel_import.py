"""Triton kernels imported on first use, so that `import ringlse` needs neither Triton nor a GPU: the
one way the package reaches `ringlse.kernels` (and the LSE toolkit its `ringlse.lse.kernels`)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from types import ModuleType


@functools.cache
def kernel_module(name: str, package: str = "ringlse.kernels") -> ModuleType | None:
    """`<package>.<name>`, or None where the caller's PyTorch path serves: no Triton, or a source tree
    used without `pip install -e .` (`kernels/` installs as `ringlse.kernels`, which the LSE toolkit's
    kernels import too; said once)."""
    try:
        return importlib.import_module(f"{package}.{name}")
    except ImportError as err:
        if have_triton():
            warnings.warn(f"{package}.{name} is not importable ({err}); the PyTorch path serves", RuntimeWarning)
        return None


@functools.cache
def have_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter (`TRITON_INTERPRET=1`)."""
    try:
        from ringlse.kernels.host import interpreting as kernels_interpreting  # imports no Triton
    except ImportError:
        return False  # no kernels to interpret
    return kernels_interpreting()
