"""`ring_attention`, the public entry point of the ring (CONVENTIONS.md §6): options into a `RingSpec`,
then the one autograd path of `ringlse.ops` (the plan: `ringlse.ring.entry`; the loops: `ringlse.ring.forward`, `ringlse.ring.backward`)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringlse import ops
from ringlse.blocks.contract import BlockOp
from ringlse.ring.head_parallel import head_parallel_ring
from ringlse.sinks import check_sinks
from ringlse.specs import RingSpec


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str | None = None,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    backend: str | BlockOp = "auto",
    timeout: datetime.timedelta | float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    head_group: dist.ProcessGroup | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over a sequence sharded across the ranks of `group`.

    Args:
        q: this rank's queries `[batch, n, nheads, headdim]` (n = S / W tokens, placed by `layout`).
        k, v: this rank's keys `[batch, n, nheads_kv, headdim]` and values `[batch, n, nheads_kv,
            headdim_v]` (same positions as q; GQA/MQA without repeating K/V). `headdim_v` may differ
            from `headdim` (DeepSeek-style MLA) on the `torch` and `triton` backends; the others raise
            ValueError naming it, on every rank.
        causal: causal mask over global positions.
        softmax_scale: defaults to `headdim ** -0.5`.
        group: process group (default: the world; without torch.distributed, a single rank).
        layout: `zigzag` (default when causal), `contiguous` (default otherwise), `stripe`, or
            `balanced` (packed documents: needs `cu_seqlens`; CONVENTIONS.md §5); use `ringlse.shard`
            (with the same `cu_seqlens` for `balanced`) to split a full sequence the same way.
        return_lse: also return lse `[batch, nheads, n]` (float32; float64 for float64 inputs).
        window_size: `(left, right)` at global positions, -1 unbounded (CONVENTIONS.md §10).
        cu_seqlens: document boundaries over the *global* sequence `[0, ..., S]`, the same on every
            rank; documents need no divisibility and may cross ranks in any layout. Backends without
            intervals get one call per document (windows: `fa4` takes them as a rule), as on one device;
            the `stripe` layout needs a backend that takes intervals (`ringlse.available_backends(device,
            masked=True)`; `auto` picks one).
        backend: block op: `auto` (`triton` on CUDA, `torch` on CPU), `triton`, `sdpa`, `flash`, `torch`,
            or a `BlockOp`.
        sinks: learnable attention sinks `[nheads]`, as in `ringlse.block_attention`: each rank merges
            them into its own rows once, after the ring (the returned lse includes them).
        timeout: the longest any one wait of this call (the agreement, each K/V transfer, each dk/dv
            message, forward and backward) may take, as a `datetime.timedelta` or seconds; default:
            the process group's timeout. On NCCL an explicit one makes the host wait for each
            transfer (`Work.wait(timeout)`); without it the NCCL watchdog enforces the group's.
        softcap: 0 (off) or `s > 0`: scores capped to `s * tanh(scale * q.k / s)` before the softmax
            (`torch` and `triton` backends; the ranks must agree on it).
        head_group: head parallelism x ring (None: the ring alone). The U ranks of `head_group` hold
            one ring part of `group`'s ring, each a contiguous piece of it (`ringlse.shard(...,
            head_group=)`, CONVENTIONS.md §5.1): q/k/v are then this rank's `n = S / (R·U)` tokens of
            every head. An all-to-all over `head_group` gives each rank the ring part for `h/U` heads
            (K/V heads split alike where they divide over U, else each rank gets those its query heads
            read), the ring runs over `group` on them, and an all-to-all brings out and lse back. Every
            rank of `group` must hold the same head-group rank, every rank of `head_group` the same ring
            rank. `nheads % U != 0` raises ValueError on every rank of both groups before anything moves.

    Returns:
        This rank's `out` `[batch, n, nheads, headdim_v]` (q's dtype), or `(out, lse)` (lse
        `[batch, nheads, n]`). Differentiable: autograd returns exact `dq`, `dk`, `dv` for the local shards.

    Raises:
        ValueError: on every rank, before any K/V moves, when a rank's inputs are invalid (shapes,
            dtypes, devices, divisibility, timeout) or the ranks disagree on shapes/dtype/options;
            the same text on every rank, naming every rank's problem.
        RuntimeError: when a rank dies or stalls: every surviving rank, within the timeout, naming
            the phase, the ring step and the peer it waited for; and at once on a group where an
            earlier ring call failed (README "Failure behaviour").
    """
    spec = RingSpec.make(causal=causal, softmax_scale=softmax_scale, group=group, layout=layout,
                         return_lse=return_lse, window_size=window_size, cu_seqlens=cu_seqlens, backend=backend,
                         timeout=timeout, softcap=softcap)
    problem = check_sinks(sinks, q, "ring_attention") if isinstance(q, torch.Tensor) else None
    if problem is not None:  # raised on every rank together, through the agreement
        spec = spec.with_problem(problem)
        sinks = None
    if head_group is not None:
        out, lse = head_parallel_ring(q, k, v, spec, sinks, head_group)
    else:
        out, lse = ops.ring(q, k, v, spec, sinks)
    return (out, lse) if return_lse else out
