"""Gradients as sums of parts: collect the tensors block kernels return, add them up once at the end.

A ring backward adds many blocks' gradients into the same local `dq`, `dk`, `dv`. Kernels that return
their gradients as new tensors (cuDNN, flash-attn: bf16 for bf16 inputs) used to be added one by one
into float32 accumulators, a 10-byte read-modify-write per element per block. `PartSum` instead keeps
each part (a tensor placed at a row offset, with a scale) and sums them in float32 with one pass that
reads every part once and writes the result in its final dtype: the same sum, in the same precision
(each part is exact in float32), with a fraction of the memory traffic. Ops that accumulate in-kernel
(ours, PyTorch math) get a float32 accumulator instead, which is just one more part.

On CUDA the pass is the `ringlse.kernels.sum_parts` kernel; elsewhere (or without Triton) PyTorch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringlse.blockop import GradPart
from ringlse.kernel_import import kernel_module

# parts kept before they are folded into the float32 accumulator (bounds the memory held to
# this many block gradients; the kernel sums this many in one launch)
MAX_PENDING = 8
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sum_parts(
    shape: Sequence[int], parts: Sequence[GradPart], dtype: torch.dtype, device: torch.device | str, acc_dtype: torch.dtype
) -> torch.Tensor:
    """`sum_i part_i.scale * part_i.value`, each placed at rows `[start, start + len)` of dim 1.

    Args:
        shape: the result's shape `[b, n, ...]`; every part is `[b, len, ...]` with the same trailing dims.
        parts: the parts (any float dtypes; rows no part covers are 0).
        dtype: the result's dtype.
        device: the result's device.
        acc_dtype: the dtype the sum is computed in (float32, or float64 for float64 inputs).

    Returns:
        A contiguous tensor of `shape` and `dtype`: the part's own tensor when a single unscaled part
        of that dtype is the whole result (a kernel output sent or returned as it is), else a new one.
    """
    parts = [p for p in parts if p.value.shape[1] > 0]
    if len(parts) == 1:
        p = parts[0]
        if p.start == 0 and p.scale == 1.0 and p.value.dtype == dtype and tuple(p.value.shape) == tuple(shape):
            return p.value.contiguous()
    kernel = kernel_module("sum_parts") if torch.device(device).type == "cuda" else None
    if kernel is not None and acc_dtype == torch.float32 and dtype in _KERNEL_DTYPES and parts and all(
        p.value.dtype in _KERNEL_DTYPES for p in parts
    ):
        out = torch.empty(tuple(shape), dtype=dtype, device=device)
        return kernel.sum_parts_into(out, [(p.start, p.value.contiguous(), p.scale) for p in parts])
    out = torch.zeros(tuple(shape), dtype=acc_dtype, device=device)
    add_parts(out, parts)
    return out if dtype == acc_dtype else out.to(dtype)


def add_parts(acc: torch.Tensor, parts: Sequence[GradPart]) -> None:
    """`acc[:, start : start + len] += scale * value` for each part, in acc's dtype."""
    for p in parts:
        rows = acc[:, p.start : p.start + p.value.shape[1]]
        if p.scale == 1.0:
            rows += p.value
        else:
            rows += p.scale * p.value.to(acc.dtype)


class PartSum:
    """A `[b, n, ...]` gradient built from parts; `result()` sums them in one pass.

    Args:
        shape: the gradient's shape.
        acc_dtype: float32 (float64 for float64 inputs): what the sum is computed in.
        device: where it lives.
    """

    def __init__(self, shape: Sequence[int], acc_dtype: torch.dtype, device: torch.device):
        self.shape, self.acc_dtype, self.device = tuple(shape), acc_dtype, device
        self._acc: torch.Tensor | None = None
        self._parts: list[GradPart] = []

    def add(self, part: GradPart, offset: int = 0) -> None:
        """Add `part` with its rows shifted by `offset` (the block call's first row)."""
        self._parts.append(part._replace(start=part.start + offset))
        if len(self._parts) + (self._acc is not None) >= MAX_PENDING:
            self._fold()

    def accumulator(self) -> torch.Tensor:
        """A float32/float64 tensor of the full shape that in-place ops may add into (starts at 0)."""
        if self._acc is None:
            self._acc = torch.zeros(self.shape, dtype=self.acc_dtype, device=self.device)
        return self._acc

    def _fold(self) -> None:
        parts = self._parts if self._acc is None else [GradPart(0, self._acc), *self._parts]
        self._acc = sum_parts(self.shape, parts, self.acc_dtype, self.device, self.acc_dtype)
        self._parts = []

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The sum, as a new tensor of `dtype`."""
        parts = self._parts if self._acc is None else [GradPart(0, self._acc), *self._parts]
        return sum_parts(self.shape, parts, dtype, self.device, self.acc_dtype)
