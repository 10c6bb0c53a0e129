"""The `triton` block op: ringlse's Triton kernels (`ringlse.kernels.attention_fwd` / `_bwd`) behind
the block-op contract. The kernels take plain tensors and integers; the contract's callers already
skip blocks with nothing visible and pass `causal=True` only where a causal boundary crosses the
block (`ringlse.masks.block_kind`), which is what the kernels ask of their callers."""

from __future__ import annotations

from ringlse.blocks.contract import BlockOp
from ringlse.kernel_import import kernel_module

_fwd = kernel_module("attention_fwd")
_bwd = kernel_module("attention_bwd")
if _fwd is None or _bwd is None:
    raise ImportError("the triton backend needs Triton and the installed ringlse.kernels")

TRITON_BLOCK_OP = BlockOp("triton", _fwd.attention_forward, _bwd.attention_backward, delta=_bwd.attention_delta)
