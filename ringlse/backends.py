"""Registry of block ops by name: `triton` (ours), `sdpa` (PyTorch's flash/cuDNN ops), `flash` (the
flash-attn package), `torch` (PyTorch math). Each backend module is imported only when asked for, so
`import ringlse` needs neither Triton nor a GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from ringlse.blockop import BlockOp

# name -> (module, attribute) holding the BlockOp
_BACKENDS: dict[str, tuple[str, str]] = {
    "triton": ("ringlse.kernels.attention", "TRITON_BLOCK_OP"),
    "sdpa": ("ringlse.block_sdpa", "SDPA_BLOCK_OP"),
    "flash": ("ringlse.block_flash", "FLASH_BLOCK_OP"),
    "torch": ("ringlse.block_torch", "TORCH_BLOCK_OP"),
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def backend_unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why backend `name` cannot run on `device`, or None when it can."""
    if name not in _BACKENDS:
        return f"unknown backend {name!r}"
    if name == "torch":
        return None
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if device.type != "cuda" and not _interpreting():
            return "triton needs a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)"
        return None
    if device.type != "cuda":
        return f"{name} needs a CUDA device"
    if name == "flash" and importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    return None


def available_backends(device: torch.device | str) -> list[str]:
    """Names of the backends that can run on `device`."""
    device = torch.device(device)
    return [n for n in _BACKENDS if backend_unavailable_reason(n, device) is None]


def get_block_op(backend: str | BlockOp, device: torch.device | str) -> BlockOp:
    """The block op for `backend` on `device`; `auto` is `triton` on CUDA, `torch` elsewhere. A
    `BlockOp` is returned as it is (your own kernels, or a registry op on a device it is not
    offered for, such as `sdpa`'s CPU kernels in tests).

    Raises:
        ValueError: unknown or unavailable backend; the message lists what is available.
    """
    if isinstance(backend, BlockOp):
        return backend
    device = torch.device(device)
    name = ("triton" if device.type == "cuda" else "torch") if backend == "auto" else backend
    reason = backend_unavailable_reason(name, device)
    if reason is not None:
        raise ValueError(
            f"backend {backend!r} is not available on {device.type}: {reason}; "
            f"available here: {available_backends(device)} (or 'auto')"
        )
    module, attr = _BACKENDS[name]
    return getattr(importlib.import_module(module), attr)
