"""The block-op contract: what the ring loop, `chunked_attention` and `block_attention` call.

A block op attends one block of queries to one block of keys with global start positions (CONVENTIONS.md §4)
and comes as two plain functions, so the same loop runs with the PyTorch op on CPU and with Triton,
SDPA or flash-attn kernels on GPU. Callers pass a call's scale and mask as `BlockArgs.kwargs()`
(`ringlse.blocks.calls`).

forward(q, k, v, *, softmax_scale, causal, q_start, k_start, out_acc=None, lse_acc=None)
    q `[b, sq, h, d]`, k/v `[b, sk, hkv, d]`. Without accumulators: returns `(out, lse)`, `out` in
    q's dtype, `lse` `[b, h, sq]` float32 (float64 for float64 inputs). With `out_acc` `[b, sq, h, d]`
    and `lse_acc` `[b, h, sq]` (float32/float64, possibly strided views into larger buffers): merges
    the block into them in place (CONVENTIONS.md §3, `-inf`-safe) and returns them. Ops with
    `Capabilities.writes_fresh` also take `fresh=True` with accumulators that hold nothing yet: their
    contents are not read and every row is written (`StateRows` decides when). Ops with
    `Masks.INTERVALS` also take `intervals=` (`ringlse.masks.Intervals`) for masks other than plain
    causal (windows, documents; CONVENTIONS.md §10), with `causal=False`; backward likewise. Ops with
    `Masks.WINDOW` take `window_size=(left, right)` instead, for windows alone.

backward(dout, q, k, v, out, lse, delta, *, softmax_scale, causal, q_start, k_start, dq_acc, dk_acc, dv_acc,
         lse_grad=None)
    `out`, `lse` are the *global* results for these query rows and `delta = rowsum(dout * out) - lse_grad`
    `[b, h, sq]` (float32/float64), where `lse_grad` `[b, h, sq]` is the gradient of the global lse,
    or None when there is none (then delta is exactly `rowsum(dout * out)`). Kernels that take delta
    ignore `lse_grad`; kernels that compute `rowsum(dout * out)` themselves (cuDNN, flash-attn) add its
    term from it, so nobody has to compare two deltas on the host. Adds this block's gradients into
    the float32/float64 accumulators `dq_acc` `[b, sq, h, d]`, `dk_acc`, `dv_acc` `[b, sk, hkv, d]`
    (views allowed). Returns nothing. Ops with `Capabilities.split_backward` also take `dq_acc=None`
    (dk/dv alone) or `dk_acc=dv_acc=None` (dq alone).

How results are collected is the backend's (`BlockOp.accumulation`, `ringlse.blocks.accumulate`):
`InPlace` ops merge and add into float32 accumulators through the two functions above; `Parts` ops
(cuDNN, flash-attn) also give `forward_parts(q, k, v, **args) -> list[StatePart]` (each placed at its
first row within the block's query rows, `out` in q's dtype) and `backward_parts(dout, q, k, v, out,
lse, delta, **args, lse_grad=None) -> BlockGrads` (`GradPart`s in any float dtype with a first row and a
scale), which callers keep as parts and combine once in float32 (`StateMerge`, `PartSum`), e.g. send
a K/V block's parts to the rank that owns it without ever forming a float32 accumulator.

Callers skip blocks that `masks.block_kind` calls EMPTY and pass `causal=False` for FULL ones.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ringlse.blocks.accumulate import IN_PLACE, Accumulation, GradInputs, GradTarget, InPlace, Parts, StateRows
from ringlse.blocks.calls import BlockArgs, BlockCall, BlockGrads
from ringlse.checks import lse_dtype


def torch_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`rowsum(dout * out)`: `[b, s, h, d]` x2 -> `[b, h, s]`, float32 (float64 for float64)."""
    acc = lse_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


class Masks(enum.Enum):
    """Which masks an op takes besides plain causal at global offsets."""

    PLAIN = "plain"
    # `window_size=(left, right)` (CONVENTIONS.md §10) with `causal`, `q_start`, `k_start`: one window
    # rule over the block, which callers cut to the rows that see keys and the keys they see
    # (documents are cut per document); FlashAttention-4 has windows natively
    WINDOW = "window"
    # `intervals=` (`ringlse.masks.Intervals`: any mask where each query row sees one interval of keys:
    # windows, documents); callers pass causal=False with it
    INTERVALS = "intervals"


@dataclass(frozen=True)
class Capabilities:
    """What an op's functions take beyond the contract's minimum."""

    masks: Masks = Masks.PLAIN
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
    # forward and backward take `softcap=` (> 0): scores capped to `softcap * tanh(score / softcap)`
    softcap: bool = False
    # v may have a head dim other than q/k's (out, dout, dv and out accumulators then have v's)
    v_head_dim: bool = False
    # forward without accumulators takes `sinks=` `[h]` and returns its state with them folded in
    # (`ringlse.sinks`), in the kernel's epilogue instead of a pass over the output afterwards
    sinks: bool = False


@dataclass(frozen=True)
class BlockOp:
    """A block op: its two functions (module docstring), what they take (`caps`), how its results are
    collected (`accumulation`) and how `rowsum(dout * out)` is computed for it (`delta`)."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., None]
    caps: Capabilities = Capabilities()
    accumulation: Accumulation = IN_PLACE
    # rowsum(dout * out) in the lse layout (a backend may give a kernel), or None for kernels that
    # compute it themselves (cuDNN, flash-attn): callers then pass delta=None and skip its four passes
    # over dout and out
    delta: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = torch_delta

    def compute_delta(self, dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`rowsum(dout * out)` (the op's kernel where it has one)."""
        return (self.delta or torch_delta)(dout, out)

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
        if self.delta is None:
            return dout, None, lse_grad
        delta = self.delta(dout, out)
        if lse_grad is not None:
            delta = delta - lse_grad
        return dout, delta, lse_grad


class AttentionPlan(Protocol):
    """What `ringlse.ops` runs: a block op and how a call uses it, forward and backward."""

    op: BlockOp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(out, lse)` of the whole call (`out` in any float dtype: cast to q's). The single-device plan
        also takes `sinks` and returns the state with them folded in (`ringlse.sinks`); the ring's op
        folds them after its plan."""

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor | None, lse_grad: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(dq, dk, dv)` in the inputs' dtypes (`BlockOp.backward_inputs` made `dout`, `delta`,
        `lse_grad`)."""
