"""Attention states as parts: collect the `(out, lse)` block kernels return, merge them once at the end.

The forward's counterpart of `ringlse.part_sum`. A ring forward merges W blocks' states per query row;
kernels that return their state as new tensors (cuDNN, flash-attn: `out` in bf16) used to be merged
one by one into float32 accumulators (a zero fill, a 4-byte read and write per element per block, and
a cast at the end). `StateMerge` keeps each state as a part placed at a row offset and merges all of
them with one pass (DESIGN §3) that reads every part once and writes `out` in its final dtype: the same
merge, in float32, rounded once. Ops that merge in-kernel (ours) keep their float32 accumulators.

On CUDA the pass is the `ringlse.kernels.merge_parts` kernel; elsewhere (or without Triton) the
PyTorch merge of `ringlse.merge`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringlse.blockop import StatePart
from ringlse.kernel_import import kernel_module
from ringlse.merge import update_out_and_lse

# parts kept before they are folded into a float32 state (bounds the memory held to this many
# block outputs; the kernel merges this many in one launch)
MAX_PENDING = 8
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def merge_parts(
    shape: Sequence[int], parts: Sequence[StatePart], dtype: torch.dtype, device: torch.device | str,
    acc_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged state of row-offset parts (DESIGN §3).

    Args:
        shape: `out`'s shape `[b, n, h, d]`; every part's `out` is `[b, len, h, d]`, its lse `[b, h, len]`.
        parts: the states (rows no part covers come out `(0, -inf)`).
        dtype: `out`'s dtype.
        device: where the result lives.
        acc_dtype: the merge's dtype and the lse's (float32, or float64 for float64 inputs).

    Returns:
        `(out, lse)`: contiguous `[b, n, h, d]` in `dtype` and `[b, h, n]` in `acc_dtype`; a lone part
        that covers every row in those dtypes is returned as it is.
    """
    b, n, h, _ = shape
    parts = [p for p in parts if p.out.shape[1] > 0]
    if len(parts) == 1:
        p = parts[0]
        if p.start == 0 and tuple(p.out.shape) == tuple(shape) and p.out.dtype == dtype and p.lse.dtype == acc_dtype:
            return p.out.contiguous(), p.lse.contiguous()
    kernel = kernel_module("merge_parts") if torch.device(device).type == "cuda" else None
    if kernel is not None and acc_dtype == torch.float32 and dtype in _KERNEL_DTYPES and parts and all(
        p.out.dtype in _KERNEL_DTYPES and p.lse.dtype == torch.float32 for p in parts
    ):
        out = torch.empty(tuple(shape), dtype=dtype, device=device)
        lse = torch.empty((b, h, n), dtype=acc_dtype, device=device)
        return kernel.merge_parts_into(out, lse, [(p.start, p.out.contiguous(), p.lse.contiguous()) for p in parts])
    out = torch.zeros(tuple(shape), dtype=acc_dtype, device=device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc_dtype, device=device)
    for p in parts:
        rows = slice(p.start, p.start + p.out.shape[1])
        update_out_and_lse(out[:, rows], lse[:, :, rows], p.out, p.lse.to(acc_dtype), inplace=True)
    return (out if dtype == acc_dtype else out.to(dtype)), lse


class StateMerge:
    """A `[b, n, h, d]` attention state built from parts; `result()` merges them in one pass.

    Args:
        shape: `out`'s shape.
        acc_dtype: float32 (float64 for float64 inputs): what the merge is computed in.
        device: where it lives.
    """

    def __init__(self, shape: Sequence[int], acc_dtype: torch.dtype, device: torch.device):
        self.shape, self.acc_dtype, self.device = tuple(shape), acc_dtype, device
        self._parts: list[StatePart] = []

    def add(self, part: StatePart, offset: int = 0) -> None:
        """Add `part` with its rows shifted by `offset` (the block call's first row)."""
        self._parts.append(part._replace(start=part.start + offset))
        if len(self._parts) >= MAX_PENDING:  # fold into one float32 state, which becomes the first part
            out, lse = merge_parts(self.shape, self._parts, self.acc_dtype, self.device, self.acc_dtype)
            self._parts = [StatePart(0, out, lse)]

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(out, lse)`: the merge, `out` as a new tensor of `dtype` (or a lone whole part as it is)."""
        return merge_parts(self.shape, self._parts, dtype, self.device, self.acc_dtype)
