"""How a block op's results are collected, supplied by the backend (`BlockOp.accumulation`), so that
no caller branches on the kind of op.

- `InPlace` (ringlse's Triton kernels, PyTorch math): the op merges its state into float32
  accumulators (`StateRows`) and adds its gradients into float32 tensors (a `PartSum`'s accumulator,
  or a dk/dv message buffer that callers hand in, such as a copy-engine slot).
- `Parts(forward, backward)` (cuDNN, flash-attn): the kernels return new tensors, kept as parts
  (`StateMerge`, `PartSum`) and combined once in float32, so no float32 accumulator is read and
  rewritten per block.

Both take the same calls: `state(...)` for the forward, `add_grads(...)` for the backward with
`GradTarget`s (a `PartSum` and the rows of it a call fills), and for gradients that travel (the
ring's dk/dv) `message_groups`, `message_dtype` and `message`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from ringlse.blocks.calls import BlockArgs, BlockCall, BlockGrads
from ringlse.checks import lse_dtype
from ringlse.kv_pack import KVPack
from ringlse.merge import PartSum, StateMerge, StatePart


class BlockFunctions(Protocol):
    """What the accumulations call of a block op (`ringlse.blocks.contract.BlockOp`, which imports this
    module: its accumulation is a field of it)."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., None]

    @property
    def writes_fresh(self) -> bool:
        """Whether forward takes `fresh=True` (`Capabilities.writes_fresh`)."""


class StateRows:
    """A call's running state, `out` `[b, n, h, d]` and `lse` `[b, h, n]` in float32 (float64 for float64
    inputs), filled by block calls over row ranges.

    The first call over rows no call has written yet writes its state there (`fresh`, for ops with
    `Capabilities.writes_fresh`) instead of merging into zeros it would first read: the ring's first block
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

    def add(self, op: BlockFunctions, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, q1: int, **block) -> None:
        """Attend `q` (the rows `[q0, q1)` of the state) to `k`, `v` through `op` (`block`: the
        forward's other keyword arguments), into the state."""
        gaps = self._unwritten(q0, q1)
        fresh = gaps == [(q0, q1)] and op.caps.writes_fresh
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


class StateSink(Protocol):
    """A forward's state under construction (`Accumulation.state`)."""

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, q1: int, args: BlockArgs) -> None:
        """Attend `q` (rows `[q0, q1)` of the state) to `k`, `v` into the state."""

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(out, lse)`: `out` in `dtype` or float32 (callers cast), every row written."""


class GradTarget(NamedTuple):
    """Rows `[start, stop)` of the gradient `total` that one block call's gradient goes into."""

    total: PartSum
    start: int
    stop: int

    def view(self) -> torch.Tensor:
        return self.total.accumulator()[:, self.start:self.stop]


class GradInputs(NamedTuple):
    """A backward's operands over all query rows (`BlockOp.backward_inputs` made `dout`, `delta`, `lse_grad`)."""

    dout: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor | None
    lse_grad: torch.Tensor | None

    def operands(self, c: BlockCall, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple, torch.Tensor | None]:
        """`((dout, q, k, v, out, lse, delta), lse_grad)` of call `c`, with `k`, `v` the keys it reads from."""
        rows = slice(c.q0, c.q1)
        delta = None if self.delta is None else self.delta[:, :, rows]
        args = (self.dout[:, rows], self.q[:, rows], k[:, c.k0:c.k1], v[:, c.k0:c.k1], self.out[:, rows],
                self.lse[:, :, rows], delta)
        return args, None if self.lse_grad is None else self.lse_grad[:, :, rows]


class InPlace:
    """Results merged and added in place by the op (see the module docstring)."""

    # a message can be built in a buffer the caller supplies (a copy-engine slot)
    builds_into = True

    def state(self, op: BlockFunctions, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> StateSink:
        return _RowsState(op, StateRows(shape, dtype, device))

    def add_grads(self, op: BlockFunctions, g: GradInputs, c: BlockCall, kv: tuple[torch.Tensor, torch.Tensor],
                  args: BlockArgs, dq: GradTarget | None, dk: GradTarget | None, dv: GradTarget | None) -> None:
        """Add call `c`'s gradients into the targets (None: not computed; `Capabilities.split_backward`)."""
        operands, lse_grad = g.operands(c, *kv)
        op.backward(*operands, **args.kwargs(), lse_grad=lse_grad, dq_acc=None if dq is None else dq.view(),
                    dk_acc=None if dk is None else dk.view(), dv_acc=None if dv is None else dv.view())

    def message_groups(self, calls: Sequence[BlockCall]) -> list[list[BlockCall]]:
        """The calls whose dk/dv travel as one message: all of them, over the keys they span."""
        return [list(calls)] if calls else []

    def message_dtype(self, call: BlockCall, q: torch.Tensor, k: torch.Tensor, with_lse: bool) -> torch.dtype:
        """What dk/dv travel in: the float32 (float64) accumulation."""
        return lse_dtype(q.dtype)

    def message(self, pack: KVPack, dtype: torch.dtype, device: torch.device,
                into: torch.Tensor | None = None) -> tuple[PartSum, PartSum]:
        """A dk and a dv of `pack`'s shapes to add into, over `into` (a zeroed flat buffer of `pack`) or a
        new zeroed one."""
        dk, dv = pack.views(pack.zeros(dtype, device) if into is None else into)
        return _over(dk), _over(dv)


class Parts:
    """Results returned as new tensors by `forward(q, k, v, **args) -> list[StatePart]` and
    `backward(dout, q, k, v, out, lse, delta, **args, lse_grad) -> BlockGrads` (see the module docstring)."""

    builds_into = False

    def __init__(self, forward: Callable[..., list[StatePart]], backward: Callable[..., BlockGrads]):
        self.forward, self.backward = forward, backward

    def state(self, op: BlockFunctions, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> StateSink:
        return _MergedState(self.forward, StateMerge(shape, dtype, device))

    def add_grads(self, op: BlockFunctions, g: GradInputs, c: BlockCall, kv: tuple[torch.Tensor, torch.Tensor],
                  args: BlockArgs, dq: GradTarget | None, dk: GradTarget | None, dv: GradTarget | None) -> None:
        """Keep call `c`'s gradients as parts of the targets (None: dropped)."""
        operands, lse_grad = g.operands(c, *kv)
        grads = self.backward(*operands, **args.kwargs(), lse_grad=lse_grad)
        for target, parts in ((dq, grads.dq), (dk, grads.dk), (dv, grads.dv)):
            if target is not None:
                for part in parts:
                    target.total.add(part, target.start)

    def message_groups(self, calls: Sequence[BlockCall]) -> list[list[BlockCall]]:
        """The calls whose dk/dv travel as one message: each alone (its parts summed once, or sent as they are)."""
        return [[c] for c in calls]

    def message_dtype(self, call: BlockCall, q: torch.Tensor, k: torch.Tensor, with_lse: bool) -> torch.dtype:
        """A full block without GQA group sums and without an lse-gradient term (possible only when the
        lse is not returned) is one kernel output in the input dtype: sent as it is, exact. Anything
        else is summed in float32 and travels so."""
        if not call.causal and q.shape[2] == k.shape[2] and not with_lse:
            return k.dtype
        return lse_dtype(q.dtype)

    def message(self, pack: KVPack, dtype: torch.dtype, device: torch.device,
                into: torch.Tensor | None = None) -> tuple[PartSum, PartSum]:
        """A dk and a dv of `pack`'s shapes, summed from parts in float32 (float64) when sent."""
        if into is not None:
            raise ValueError("ops that return parts build no message in a given buffer")
        acc = lse_dtype(dtype)
        return PartSum(pack.k, acc, device), PartSum(pack.v, acc, device)


Accumulation = InPlace | Parts
IN_PLACE = InPlace()


def _over(buf: torch.Tensor) -> PartSum:
    """A `PartSum` whose accumulator is `buf` (zeroed): its result in `buf`'s dtype is `buf` itself."""
    return PartSum(buf.shape, buf.dtype, buf.device, accumulator=buf)


class _RowsState:
    def __init__(self, op: BlockFunctions, rows: StateRows):
        self.op, self.rows = op, rows

    def add(self, q, k, v, q0: int, q1: int, args: BlockArgs) -> None:
        self.rows.add(self.op, q, k, v, q0, q1, **args.kwargs())

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.result()  # the float32 accumulator: callers cast once


class _MergedState:
    def __init__(self, forward: Callable[..., list[StatePart]], merge: StateMerge):
        self.forward, self.merge = forward, merge

    def add(self, q, k, v, q0: int, q1: int, args: BlockArgs) -> None:
        for part in self.forward(q, k, v, **args.kwargs()):
            self.merge.add(part, q0)

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.merge.result(dtype)
