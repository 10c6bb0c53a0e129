"""Head parallelism x ring (`ring_attention(..., group=ring_group, head_group=head_group)`): U ranks of
a head group hold one ring part, each a contiguous piece of its tokens for every head (CONVENTIONS.md
§5.1). An all-to-all over the head group gives each rank the whole ring part for h/U heads; the ring
runs over `group` on those heads (the one ring path, `ringlse.ops.ring`); an all-to-all brings out and
lse back. The backward mirrors it: autograd runs the same exchanges backwards (`ringlse.ring.all_to_all`).

Before anything moves, the ranks of the head group compare a row (shapes, dtype, ring rank and size, a
digest of the options) and any problem a rank found alone (heads that do not divide over U among
them). If any rank of a head group finds a problem, all of them take it into the ring's own agreement
instead of the all-to-all, so every rank of every ring raises, and since every ring holds one rank of
every head group, every rank of both groups raises `ValueError` together. The ring's agreement then
checks that its ranks hold the same heads (`RingSpec.head_split`).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from ringlse import ops
from ringlse.checks import SUPPORTED_DTYPES, check_qkv
from ringlse.ring.all_to_all import exchange
from ringlse.ring.comm import RingComm
from ringlse.ring.entry import check_local, check_timeout
from ringlse.ring.head_split import HeadSplit
from ringlse.ring.layout import default_layout
from ringlse.specs import RingSpec, error_message, group_from_name

_NAMES = ("q shape", "k shape", "v shape", "dtype", "ring group (rank, size)",
          "options (causal, softmax_scale, layout, return_lse, window_size, cu_seqlens, softcap, sinks)")
_ROW = 4 + 4 + 4 + 1 + 2 + 1


def _options_digest(spec: RingSpec, sinks: Tensor | None, head_dim: int) -> int:
    """A 56-bit digest of the options the head group's ranks must share (the row holds int64), defaults
    resolved as the ring resolves them."""
    docs = None if spec.cu_seqlens is None else [int(x) for x in spec.cu_seqlens.tolist()]
    scale = head_dim**-0.5 if spec.softmax_scale is None else spec.softmax_scale
    options = (spec.causal, scale, spec.layout or default_layout(spec.causal is True), spec.return_lse,
               tuple(spec.window_size), docs, spec.softcap, sinks is not None)
    return int.from_bytes(hashlib.blake2b(repr(options).encode(), digest_size=7).digest(), "little")


def _row(q: Tensor, k: Tensor, v: Tensor, spec: RingSpec, sinks: Tensor | None) -> list[int]:
    ring = group_from_name(spec.group)
    return [*q.shape, *k.shape, *v.shape, SUPPORTED_DTYPES.index(q.dtype), dist.get_rank(ring),
            dist.get_world_size(ring), _options_digest(spec, sinks, q.shape[3])]


def _describe(row: Sequence[int]) -> dict[str, str]:
    """A head-group row as named fields, for a disagreement's message."""
    r = [int(x) for x in row]
    if r[0] < 0:
        return {name: "(invalid)" for name in _NAMES}
    dtype = SUPPORTED_DTYPES[r[12]] if 0 <= r[12] < len(SUPPORTED_DTYPES) else r[12]
    values = (tuple(r[0:4]), tuple(r[4:8]), tuple(r[8:12]), dtype, (r[13], r[14]), f"digest {r[15]:014x}")
    return {name: str(value) for name, value in zip(_NAMES, values)}


def _local_problem(q, k, v, spec: RingSpec, comm: RingComm
                   ) -> tuple[HeadSplit | None, datetime.timedelta | None, str | None]:
    """`(split, limit, problem)`: the head split of this rank's inputs and the bound of each wait, or why
    there are none (as a message: every rank must still reach the head group's agreement)."""
    if spec.error:
        return None, None, error_message(spec.error)
    try:
        check_qkv(q, k, v, "ring_attention")
        check_local(q, k, comm)
        if dist.get_rank(group_from_name(spec.group)) < 0:
            raise ValueError("ring_attention: this process is not a member of the given process group")
        limit = check_timeout(spec.timeout)
        return HeadSplit.of(q.shape[2], k.shape[2], comm.world), limit, None
    except (ValueError, TypeError) as e:
        return None, None, str(e)


def _refuse(q, k, v, spec: RingSpec, problem: str) -> NoReturn:
    """Take `problem` into the ring's agreement, which raises it on every rank of the ring."""
    ops.ring(q, k, v, spec.with_problem(problem))
    raise ValueError(problem)  # not reached: a ring with a problem raises


def _scatter_inputs(q: Tensor, k: Tensor, v: Tensor, split: HeadSplit) -> Tensor:
    """q, k, v `[b, n, h | hkv, d]` packed as `[U, b, n, C]`: slot u holds head block u's query heads
    and its K/V heads (`HeadSplit`) side by side, so one all-to-all moves all three."""
    b, n, size = q.shape[0], q.shape[1], split.size
    if not split.kv_split_as_is:  # K/V heads repeated or selected per rank; autograd sums their gradients
        index = torch.tensor(split.kv_heads, device=k.device)
        k, v = k.index_select(2, index), v.index_select(2, index)
    return torch.cat([t.reshape(b, n, size, -1).movedim(2, 0) for t in (q, k, v)], dim=3)  # one copy, contiguous


def _gather_inputs(packed: Tensor, q: Tensor, v: Tensor, split: HeadSplit) -> tuple[Tensor, Tensor, Tensor]:
    """The exchanged `[U, b, n, C]` (slot i: rank i's tokens) as q, k, v `[b, U·n, h/U | m, d]`."""
    size, b, n, _ = packed.shape
    hu, m, d, dv = split.heads_per_rank, split.kv_per_rank, q.shape[3], v.shape[3]
    whole = packed.movedim(0, 1).reshape(b, size * n, -1)  # a view for batch 1, else one copy
    q2, k2, v2 = whole.split([hu * d, m * d, m * dv], dim=2)
    return q2.reshape(b, size * n, hu, d), k2.reshape(b, size * n, m, d), v2.reshape(b, size * n, m, dv)


def head_parallel_ring(q: Tensor, k: Tensor, v: Tensor, spec: RingSpec, sinks: Tensor | None,
                       head_group: dist.ProcessGroup) -> tuple[Tensor, Tensor | None]:
    """`(out, lse)` of one head-parallel ring call over the ring `spec.group` and `head_group` (lse None
    unless `spec.return_lse`): q `[b, n, h, d]`, k/v `[b, n, hkv, d]` of this rank's
    piece (n = S / (R·U)), out `[b, n, h, d]`, lse `[b, h, n]`; differentiable in q, k, v and `sinks`."""
    comm = RingComm.for_group(head_group)
    comm.check_usable()
    split, limit, problem = _local_problem(q, k, v, spec, comm)
    meta = _row(q, k, v, spec, sinks) if problem is None else [-1] * _ROW
    check = comm.post_agreement(meta, problem, limit, _describe)
    packed = _scatter_inputs(q, k, v, split) if split is not None else None  # while the rows travel
    try:
        check()
    except ValueError as e:
        _refuse(q, k, v, spec, problem or f"head group: {str(e).removeprefix('ring_attention: ')}")
    limit = comm.transfer_limit(limit)
    phases = ("forward all-to-all of q/k/v", "backward all-to-all of dq/dk/dv")
    q2, k2, v2 = _gather_inputs(exchange(comm, limit, phases, packed)[0], q, v, split)
    ring_spec = dataclasses.replace(spec, head_split=(comm.rank, comm.world))
    b, n, size, hu = q.shape[0], q.shape[1], split.size, split.heads_per_rank
    # this rank's query heads [u·h/U, (u+1)·h/U) fold their sinks in the ring's op, as the plain ring does
    local_sinks = None if sinks is None else sinks[comm.rank * hu:(comm.rank + 1) * hu]
    out2, lse2 = ops.ring(q2, k2, v2, ring_spec, local_sinks)
    sends = [out2.reshape(b, size, n, -1).movedim(1, 0)]  # slot u: rank u's tokens, this rank's heads
    if spec.return_lse:
        sends.append(lse2.reshape(b, hu, size, n).movedim(2, 0))
    phases = ("forward all-to-all of out/lse", "backward all-to-all of dout/dlse")
    got = exchange(comm, limit, phases, *sends)
    out = got[0].movedim(0, 2).reshape(b, n, q.shape[2], -1)
    lse = got[1].movedim(0, 1).reshape(b, q.shape[2], n) if spec.return_lse else None
    return out, lse
