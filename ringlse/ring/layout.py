"""Sequence layouts across W ranks (CONVENTIONS.md §5) and `shard`/`unshard`.

A layout says which global positions each rank holds. Every layout keeps a rank's positions
increasing in local index, as runs of a fixed stride (`segments`); the ring's plans
(`ringlse.ring.plan`) turn the mask rule into block calls over those runs. `contiguous`, `zigzag` and
`stripe` are fixed by S and W (a name is the whole layout); `balanced` also needs the document
boundaries, so it is passed around as a `Balanced` value (hashable: the plans' caches take it as a key).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist

from ringlse.masks import Rule, check_docs, visible_per_position
from ringlse.ring.balance import MIN_CHUNK, assign
from ringlse.ring.head_split import gather_head_pieces, head_piece

LAYOUTS = ("contiguous", "zigzag", "stripe")  # fixed by S and W alone
BALANCED = "balanced"  # needs the document boundaries too (`cu_seqlens`)
LAYOUT_NAMES = (*LAYOUTS, BALANCED)  # every name `layout=` takes


@dataclass(frozen=True)
class Balanced:
    """The `balanced` layout of one packing: chunks assigned so that every rank's queries have the same
    causal work under the documents `docs` (`ringlse.ring.balance`)."""

    docs: tuple[int, ...]
    name: ClassVar[str] = BALANCED


Layout = str | Balanced


def default_layout(causal: bool) -> str:
    """The layout `ring_attention` and the transformers integration use when none is given (the one
    place it is chosen): zigzag balances causal work; contiguous is simplest otherwise. With packed
    documents `balanced` balances them (CONVENTIONS.md §5) but is not the default until GPU timings
    say its runs cost the kernels less than zigzag's imbalance."""
    return "zigzag" if causal else "contiguous"


def layout_of(layout: Layout, cu_seqlens: Sequence[int] | torch.Tensor | None, seqlen: int, what: str) -> Layout:
    """`layout` with what it needs to place tokens: the name `balanced` with the document boundaries
    `cu_seqlens` over the global sequence of `seqlen` tokens becomes a `Balanced`; other names (and a
    `Balanced`) stay as they are, whatever `cu_seqlens`. ValueError names a `balanced` without them."""
    if layout != BALANCED:
        return layout
    docs = check_docs(cu_seqlens, seqlen, what)
    if docs is None:
        raise ValueError(f"{what}: the {BALANCED!r} layout needs cu_seqlens (the document boundaries over the "
                         "global sequence, the same on every rank): it places chunks by the documents' work")
    return Balanced(docs)


def layout_name(layout: Layout) -> str:
    return layout.name if isinstance(layout, Balanced) else layout


def check_layout(layout: Layout, seqlen: int, world: int) -> None:
    """Raise ValueError unless a sequence of `seqlen` tokens splits over `world` ranks in `layout`."""
    name = layout_name(layout)
    if name not in LAYOUT_NAMES:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUT_NAMES}")
    if name == BALANCED:
        unit = MIN_CHUNK * world
        if seqlen % unit:
            raise ValueError(f"sequence length {seqlen} does not divide over W={world} ranks in the {name!r} layout "
                             f"(needs a multiple of {MIN_CHUNK}·W = {unit}: every rank holds the same number of "
                             f"{MIN_CHUNK}-token chunks)")
        if isinstance(layout, Balanced) and layout.docs[-1] != seqlen:
            raise ValueError(f"the {name!r} layout's documents end at {layout.docs[-1]}, not at the sequence "
                             f"length {seqlen}")
        return
    parts = 2 * world if layout == "zigzag" else world
    if seqlen % parts:
        raise ValueError(
            f"sequence length {seqlen} does not divide over W={world} ranks in the {layout!r} layout "
            f"(needs a multiple of {parts}{' = 2W' if layout == 'zigzag' else ' = W'})"
        )


class Segment(NamedTuple):
    """Local rows `[local_start, local_start + length)` hold global positions
    `global_start, global_start + stride, ...`."""

    local_start: int
    length: int
    global_start: int
    stride: int


def segments(layout: Layout, rank: int, world: int, n_local: int) -> list[Segment]:
    """`rank`'s rows as runs of positions, in local order (positions increase throughout)."""
    if layout == "contiguous":
        return [Segment(0, n_local, rank * n_local, 1)]
    if layout == "zigzag":
        c = n_local // 2
        return [Segment(0, c, rank * c, 1), Segment(c, c, (2 * world - 1 - rank) * c, 1)]
    if layout == "stripe":
        return [Segment(0, n_local, rank, world)]
    if isinstance(layout, Balanced):
        check_layout(layout, n_local * world, world)
        runs, local = [], 0
        for start, length in assign(layout.docs, world)[rank]:
            runs.append(Segment(local, length, start, 1))
            local += length
        return runs
    raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUT_NAMES}")


def local_positions(layout: Layout, rank: int, world: int, n_local: int) -> torch.Tensor:
    """Global positions held by `rank`, in local order: `[n_local]` int64."""
    return torch.cat([
        s.global_start + s.stride * torch.arange(s.length) for s in segments(layout, rank, world, n_local)
    ])



def rank_work(rule: Rule, layout: Layout, world: int, seqlen: int) -> list[int]:
    """Visible (query, key) pairs of each rank's queries under `rule`, over `seqlen` tokens in `layout`:
    the ring's step time is set by its busiest rank."""
    per_position = visible_per_position(rule, seqlen)
    n = seqlen // world
    return [int(per_position[local_positions(layout, r, world, n)].sum()) for r in range(world)]


def imbalance(rule: Rule, layout: Layout, world: int, seqlen: int) -> float:
    """max / mean over ranks of `rank_work` (1.0: balanced)."""
    work = rank_work(rule, layout, world, seqlen)
    return max(work) / (sum(work) / world)

def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, layout: Layout, dim: int = 1, group: dist.ProcessGroup | None = None, *,
          cu_seqlens: Sequence[int] | torch.Tensor | None = None,
          head_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's part of a full sequence held by every rank.

    Args:
        x: the full tensor (same on every rank); sequence along `dim` of length S.
        layout: `contiguous`, `zigzag`, `stripe` or `balanced` (CONVENTIONS.md §5).
        dim: the sequence dimension.
        group: process group (default: the world; without torch.distributed, one rank).
        cu_seqlens: document boundaries `[0, ..., S]` over the global sequence: needed by `balanced`
            (pass `ring_attention` the same ones), ignored by the other layouts.
        head_group: with head parallelism (`ring_attention(head_group=...)`), the U ranks that hold one
            ring part: it is cut, in the order it holds its tokens, into U contiguous pieces, piece i
            to head-group rank i (CONVENTIONS.md §5.1): the shard is `S / (W·U)` long; a ring part
            that does not split into U pieces raises ValueError before any communication.

    Returns:
        The local shard, length `S / W` along `dim` (`S / (W·U)` with a head group; a contiguous tensor).

    Raises:
        ValueError: S does not divide over W in `layout`, or `balanced` without `cu_seqlens` (before
            any communication).
    """
    rank, world = _group_info(group)
    seqlen = x.shape[dim]
    layout = layout_of(layout, cu_seqlens, seqlen, "shard")
    check_layout(layout, seqlen, world)
    n = seqlen // world
    pos = local_positions(layout, rank, world, n).to(x.device)
    pos = head_piece(pos, head_group, seqlen)
    return x.index_select(dim, pos)


def unshard(x_local: torch.Tensor, layout: Layout, dim: int = 1, group: dist.ProcessGroup | None = None, *,
            cu_seqlens: Sequence[int] | torch.Tensor | None = None,
            head_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Gather every rank's shard and put the tokens back in sequence order (inverse of `shard`).

    Args:
        x_local: this rank's shard, length `n` along `dim` (same shape on every rank).
        layout, dim, group, cu_seqlens: as in `shard`.
        head_group: as in `shard`; the pieces of each ring part are gathered first (`n * W * U` long).

    Returns:
        The full tensor, length `n * W` along `dim` (`n * W * U` with a head group), on every rank.
    """
    x_local = gather_head_pieces(x_local, dim, head_group)
    rank, world = _group_info(group)
    n = x_local.shape[dim]
    layout = layout_of(layout, cu_seqlens, n * world, "unshard")
    check_layout(layout, n * world, world)
    if world == 1:
        return x_local.clone()
    parts = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    gathered = torch.cat(parts, dim=dim)
    pos = torch.cat([local_positions(layout, r, world, n) for r in range(world)]).to(x_local.device)
    out = torch.empty_like(gathered)
    out.index_copy_(dim, pos, gathered)
    return out
