"""Triton kernels imported on first use, so that `import ringlse` needs neither Triton nor a GPU."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """`ringlse.kernels.<name>`, or None without Triton (or in a source tree without `pip install -e .`),
    where the caller's PyTorch path serves."""
    try:
        return importlib.import_module(f"ringlse.kernels.{name}")
    except ImportError:
        return None
