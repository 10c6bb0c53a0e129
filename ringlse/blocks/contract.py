"""The block-op contract: what the ring loop, `chunked_attention` and `block_attention` call.

A block op attends one block of queries to one block of keys with global start positions (CONVENTIONS.md §4)
and comes as two plain functions, so the same loop runs with the PyTorch op on CPU and with Triton,
SDPA or flash-attn kernels on GPU.

forward(q, k, v, *, softmax_scale, causal, q_start, k_start, out_acc=None, lse_acc=None)
    q `[b, sq, h, d]`, k/v `[b, sk, hkv, d]`. Without accumulators: returns `(out, lse)`, `out` in
    q's dtype, `lse` `[b, h, sq]` float32 (float64 for float64 inputs). With `out_acc` `[b, sq, h, d]`
    and `lse_acc` `[b, h, sq]` (float32/float64, possibly strided views into larger buffers): merges
    the block into them in place (CONVENTIONS.md §3, `-inf`-safe) and returns them. Ops with
    `writes_fresh` also take `fresh=True` with accumulators that hold nothing yet: their contents are
    not read and every row is written (`StateRows` decides when). Ops with
    `takes_intervals` also take `intervals=` (`ringlse.masks.Intervals`) for masks other than plain
    causal (windows, documents; CONVENTIONS.md §10), with `causal=False`; backward likewise. Ops with
    `takes_window` take `window_size=(left, right)` instead, for windows alone.

forward_parts(q, k, v, *, softmax_scale, causal, q_start, k_start)
    Optional, for ops whose kernels return their state as new tensors (cuDNN, flash-attn): the block's
    state as `StatePart`s (`out` in q's dtype, `lse` float32, each placed at its first row within the
    block's query rows), not merged with each other. Callers merge all parts of all blocks once
    (`ringlse.merge.StateMerge`) instead of merging each into float32 accumulators.

backward(dout, q, k, v, out, lse, delta, *, softmax_scale, causal, q_start, k_start, dq_acc, dk_acc, dv_acc,
         lse_grad=None)
    `out`, `lse` are the *global* results for these query rows and `delta = rowsum(dout * out) - lse_grad`
    `[b, h, sq]` (float32/float64), where `lse_grad` `[b, h, sq]` is the gradient of the global lse,
    or None when there is none (then delta is exactly `rowsum(dout * out)`). Kernels that take delta
    ignore `lse_grad`; kernels that compute `rowsum(dout * out)` themselves (cuDNN, flash-attn) add its
    term from it, so nobody has to compare two deltas on the host. Adds this block's gradients into
    the float32/float64 accumulators `dq_acc` `[b, sq, h, d]`, `dk_acc`, `dv_acc` `[b, sk, hkv, d]`
    (views allowed). Returns nothing. Ops with `split_backward` also take `dq_acc=None` (dk/dv
    alone) or `dk_acc=dv_acc=None` (dq alone).

backward_parts(dout, q, k, v, out, lse, delta, *, softmax_scale, causal, q_start, k_start, lse_grad=None)
    Optional, for ops whose kernels return gradients as new tensors (cuDNN, flash-attn): the same
    gradients as `backward`, returned instead of added, as `BlockGrads` of `GradPart`s (a tensor in
    any float dtype, its first row within the block's query or key rows, and a scale). Callers sum
    the parts in float32 (`ringlse.merge.PartSum`) when and where they like, e.g. send a K/V block's parts
    to the rank that owns it without ever forming a float32 accumulator.

Callers skip blocks that `masks.block_kind` calls EMPTY and pass `causal=False` for FULL ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ringlse.checks import lse_dtype
from ringlse.masks import Intervals
from ringlse.merge import GradPart, StatePart


class BlockCall(NamedTuple):
    """One block-op call of a plan: query rows `[q0, q1)` attend key rows `[k0, k1)`, plain (`causal`,
    with `q_start`/`k_start` positions in any frame where only their difference matters: global
    positions for single-device plans, local indices for the ring's, `ringlse.ring.plan.plan_step`) or
    through `intervals` (with `causal=False`: windows, documents, `ringlse.masks`)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    q_start: int
    k_start: int
    intervals: Intervals | None = None
    window: tuple[int, int] | None = None  # for ops that take windows as a rule (`BlockOp.takes_window`)

    def block_args(self) -> dict:
        """The mask arguments of a block-op call for this call."""
        kw = dict(causal=self.causal, q_start=self.q_start, k_start=self.k_start)
        if self.intervals is not None:
            kw["intervals"] = self.intervals
        if self.window is not None:
            kw["window_size"] = self.window
        return kw


class BlockGrads(NamedTuple):
    """One block's gradients as parts: dq parts index the block's query rows, dk/dv parts its key rows."""

    dq: list[GradPart]
    dk: list[GradPart]
    dv: list[GradPart]


@dataclass(frozen=True)
class BlockOp:
    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., None]
    # rowsum(dout * out) in the lse layout; a backend may override it with a kernel
    delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # False for kernels that compute rowsum(dout * out) themselves (cuDNN, flash-attn): callers then
    # pass delta=None and skip its four passes over dout and out
    uses_delta: bool = True
    # returns the gradients as parts instead of adding them (see the module docstring), or None
    backward_parts: Callable[..., BlockGrads] | None = None
    # returns the block's state as parts instead of merging it (see the module docstring), or None
    forward_parts: Callable[..., list[StatePart]] | None = None
    # forward/backward take `intervals=` (`ringlse.masks.Intervals`: any mask where each query row
    # sees one interval of keys: windows, documents); callers pass causal=False with it
    takes_intervals: bool = False
    # forward/backward take `window_size=(left, right)` (CONVENTIONS.md §10) with `causal`, `q_start`,
    # `k_start`: one window rule over the block, which callers cut to the rows that see keys and the
    # keys they see (documents are cut per document); FlashAttention-4 has windows natively
    takes_window: bool = False
    # backward takes `dq_acc=None` (dk/dv alone) or `dk_acc=dv_acc=None` (dq alone): the ring then
    # computes a step's dk/dv in pieces of keys, each sent home while the next is built, and its dq
    # once (`ringlse.ring.backward`)
    split_backward: bool = False
    # forward takes `fresh=True` with accumulators that hold nothing yet: it writes the block's state
    # into every row instead of reading and merging (`StateRows`)
    writes_fresh: bool = False
    # with split_backward: `(q, k, v) -> bool`, whether the backward adds dq in the same pass as dk/dv
    # for these inputs; the ring then adds dq with each piece instead of in a second pass over the step
    dq_with_dkdv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], bool] | None = None

    def compute_delta(self, dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.delta is not None:
            return self.delta(dout, out)
        return torch_delta(dout, out)

    def backward_inputs(
        self, g_out: torch.Tensor | None, g_lse: torch.Tensor | None, out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(dout, delta, lse_grad)` for a backward pass that received gradients of out and/or lse
        (None where autograd has none: callers `set_materialize_grads(False)`); delta is None for ops
        that do not use it.

        `d lse_i / d s_ij = p_ij`, so an lse gradient enters as a shift of delta: the kernels then
        compute `ds = p * (dp - delta + g_lse)` without knowing about it.
        """
        dout = torch.zeros_like(out) if g_out is None else g_out.contiguous()
        lse_grad = None if g_lse is None else g_lse.to(lse_dtype(out.dtype))
        if not self.uses_delta:
            return dout, None, lse_grad
        delta = self.compute_delta(dout, out)
        if lse_grad is not None:
            delta = delta - lse_grad
        return dout, delta, lse_grad


class StateRows:
    """A call's running state, `out` `[b, n, h, d]` and `lse` `[b, h, n]` in float32 (float64 for float64
    inputs), filled by block calls over row ranges.

    The first call over rows no call has written yet writes its state there (`fresh`, for ops with
    `BlockOp.writes_fresh`) instead of merging into zeros it would first read: the ring's first block
    and `chunked_attention`'s first chunk cost a plain forward, and no accumulator is zeroed. Rows a
    call shares with earlier ones get `(0, -inf)` where nothing was written yet, then the merge; rows no
    call wrote get `(0, -inf)` in `result`."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        b, n, h, d = shape
        self.out = torch.empty((b, n, h, d), dtype=dtype, device=device)
        self.lse = torch.empty((b, h, n), dtype=dtype, device=device)
        self._written: list[tuple[int, int]] = []  # disjoint row ranges, in no order

    def _empty(self, q0: int, q1: int) -> None:
        self.out[:, q0:q1].zero_()
        self.lse[:, :, q0:q1].fill_(float("-inf"))

    def _unwritten(self, q0: int, q1: int) -> list[tuple[int, int]]:
        gaps, at = [], q0
        for a, b in sorted(self._written):
            if b <= at or a >= q1:
                continue
            if a > at:
                gaps.append((at, a))
            at = max(at, b)
        return gaps + ([(at, q1)] if at < q1 else [])

    def add(self, op: BlockOp, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, q1: int, **block) -> None:
        """Attend `q` (the rows `[q0, q1)` of the state) to `k`, `v` through `op` (`block`: the
        forward's other keyword arguments), into the state."""
        gaps = self._unwritten(q0, q1)
        fresh = gaps == [(q0, q1)] and op.writes_fresh
        if not fresh:
            for a, b in gaps:
                self._empty(a, b)
        self._written += gaps
        extra = {"fresh": True} if fresh else {}
        op.forward(q, k, v, **block, out_acc=self.out[:, q0:q1], lse_acc=self.lse[:, :, q0:q1], **extra)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(out, lse)`, every row written."""
        for a, b in self._unwritten(0, self.out.shape[1]):
            self._empty(a, b)
        self._written.append((0, self.out.shape[1]))
        return self.out, self.lse


def torch_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`rowsum(dout * out)`: `[b, s, h, d]` x2 -> `[b, h, s]`, float32 (float64 for float64)."""
    acc = lse_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


class AttentionPlan(Protocol):
    """What `ringlse.ops` runs: a block op and how a call uses it, forward and backward."""

    op: BlockOp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(out, lse)` of the whole call (`out` in any float dtype: cast to q's)."""

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor | None, lse_grad: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(dq, dk, dv)` in the inputs' dtypes (`BlockOp.backward_inputs` made `dout`, `delta`,
        `lse_grad`)."""
