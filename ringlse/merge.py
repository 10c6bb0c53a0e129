"""Merging attention states `(out, lse)` exactly (CONVENTIONS.md §3), with autograd, and summing
block results kept as parts.

A state is `out` `[..., seqlen, nheads, headdim]` with its `lse` `[..., nheads, seqlen]`. States merge
to `lse = logsumexp_i lse_i`, `out = sum_i exp(lse_i - lse) * out_i` (`merge_weights`, the one copy of
the formula on the PyTorch side; the kernels' copy is `ringlse.kernels.merge`).

Parts. A ring adds many blocks' results into the same rows. Kernels that return theirs as new tensors
(cuDNN, flash-attn: `out` and gradients in bf16) would otherwise be merged or added one by one into
float32 accumulators (a 4-byte read and write per element per block). `StateMerge` (forward states)
and `PartSum` (gradients) keep each block's tensors as parts placed at a row offset and combine them
once at the end, in float32, reading every part once and writing the result in its final dtype
(`ringlse.kernels.merge_parts` and `ringlse.kernels.sum_parts` on CUDA, PyTorch elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ringlse.kernel_import import kernel_module
from ringlse.merge_formula import merge_weights  # noqa: F401 (the formula's home is merge_formula)
from ringlse.merge_states import update_out_and_lse

# dtypes the part kernels read and write
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# parts kept before they are folded into one float32 part (bounds the memory held to this many block
# results; the kernels combine this many in one launch)
MAX_PENDING = 8


class GradPart(NamedTuple):
    """`scale * value` placed at rows `[start, start + value.shape[1])` of a `[b, rows, heads, d]` gradient."""

    start: int
    value: torch.Tensor
    scale: float = 1.0


class StatePart(NamedTuple):
    """An attention state `out` `[b, rows, h, d]`, `lse` `[b, h, rows]` placed at rows `[start, start + rows)`."""

    start: int
    out: torch.Tensor
    lse: torch.Tensor


def _kernels(name: str, device: torch.device | str):
    """The Triton kernels `name` for results on `device` (CUDA), else None (the PyTorch path)."""
    return kernel_module(name) if torch.device(device).type == "cuda" else None


def merge_parts(
    shape: Sequence[int], parts: Sequence[StatePart], dtype: torch.dtype, device: torch.device | str,
    acc_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged state of row-offset parts (CONVENTIONS.md §3).

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
    kernel = _kernels("merge_parts", device)
    if kernel is not None and acc_dtype == torch.float32 and dtype in _KERNEL_DTYPES and parts and all(
        p.out.dtype in _KERNEL_DTYPES and p.lse.dtype == torch.float32 for p in parts
    ):
        while len(parts) > kernel.MAX_PARTS:  # a launch takes MAX_PARTS: the first ones merged in float32 first
            head = kernel.merge_parts_into(torch.empty(tuple(shape), dtype=torch.float32, device=device),
                                           torch.empty((b, h, n), dtype=acc_dtype, device=device),
                                           [(p.start, p.out.contiguous(), p.lse.contiguous())
                                            for p in parts[:kernel.MAX_PARTS]])
            parts = [StatePart(0, *head), *parts[kernel.MAX_PARTS:]]
        out = torch.empty(tuple(shape), dtype=dtype, device=device)
        lse = torch.empty((b, h, n), dtype=acc_dtype, device=device)
        return kernel.merge_parts_into(out, lse, [(p.start, p.out.contiguous(), p.lse.contiguous()) for p in parts])
    out = torch.zeros(tuple(shape), dtype=acc_dtype, device=device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc_dtype, device=device)
    for p in parts:
        rows = slice(p.start, p.start + p.out.shape[1])
        update_out_and_lse(out[:, rows], lse[:, :, rows], p.out, p.lse.to(acc_dtype), inplace=True)
    return (out if dtype == acc_dtype else out.to(dtype)), lse


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
    kernel = _kernels("sum_parts", device)
    if kernel is not None and acc_dtype == torch.float32 and dtype in _KERNEL_DTYPES and parts and all(
        p.value.dtype in _KERNEL_DTYPES for p in parts
    ):
        while len(parts) > kernel.MAX_PARTS:  # a launch takes MAX_PARTS: the first ones summed in float32 first
            first = [(p.start, p.value.contiguous(), p.scale) for p in parts[:kernel.MAX_PARTS]]
            head = kernel.sum_parts_into(torch.empty(tuple(shape), dtype=torch.float32, device=device), first)
            parts = [GradPart(0, head), *parts[kernel.MAX_PARTS:]]
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


class _Parts:
    """Row-offset parts of one result, combined by the subclass's `_combine(parts, dtype)` when there
    are `MAX_PENDING` of them (into one float32 part) and at the end (`result`). (A method, not a
    callable kept on the object: a bound method stored on its own object is a reference cycle, which
    left the parts' tensors to the garbage collector.)"""

    def __init__(self, acc_dtype: torch.dtype):
        self.acc_dtype = acc_dtype
        self._parts: list = []

    def add(self, part, offset: int = 0) -> None:
        """Add `part` with its rows shifted by `offset` (the block call's first row)."""
        self._parts.append(part._replace(start=part.start + offset))
        if len(self._parts) >= MAX_PENDING:
            self._parts = [self._fold(self._combine(self._parts, self.acc_dtype))]

    def result(self, dtype: torch.dtype):
        """The combination of every part added, in `dtype` (a lone whole part may come as it is)."""
        return self._combine(self._parts, dtype)


class StateMerge(_Parts):
    """A `[b, n, h, d]` attention state built from `StatePart`s; `result(dtype)` merges them in one
    pass and returns `(out, lse)`.

    Args:
        shape: `out`'s shape.
        acc_dtype: float32 (float64 for float64 inputs): what the merge is computed in.
        device: where it lives.
    """

    def __init__(self, shape: Sequence[int], acc_dtype: torch.dtype, device: torch.device):
        super().__init__(acc_dtype)
        self.shape, self.device = tuple(shape), device

    def _combine(self, parts: list[StatePart], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return merge_parts(self.shape, parts, dtype, self.device, self.acc_dtype)

    @staticmethod
    def _fold(state: tuple[torch.Tensor, torch.Tensor]) -> StatePart:
        return StatePart(0, *state)


class PartSum(_Parts):
    """A `[b, n, ...]` gradient built from `GradPart`s; `result(dtype)` sums them in one pass.

    Args:
        shape: the gradient's shape.
        acc_dtype: float32 (float64 for float64 inputs): what the sum is computed in.
        device: where it lives.
    """

    def __init__(self, shape: Sequence[int], acc_dtype: torch.dtype, device: torch.device,
                 accumulator: torch.Tensor | None = None):
        self.shape, self.device = tuple(shape), device
        super().__init__(acc_dtype)
        # `accumulator`: a zeroed tensor of `shape` and `acc_dtype` to add into (a message buffer)
        self._acc: torch.Tensor | None = accumulator

    def _combine(self, parts: list[GradPart], dtype: torch.dtype) -> torch.Tensor:
        if self._acc is not None:
            parts = [GradPart(0, self._acc), *parts]
            self._acc = None
        return sum_parts(self.shape, parts, dtype, self.device, self.acc_dtype)

    @staticmethod
    def _fold(total: torch.Tensor) -> GradPart:
        return GradPart(0, total)

    def accumulator(self) -> torch.Tensor:
        """A float32/float64 tensor of the full shape that in-place ops may add into (starts at 0;
        summed with the parts at the end)."""
        if self._acc is None:
            self._acc = torch.zeros(self.shape, dtype=self.acc_dtype, device=self.device)
        return self._acc
