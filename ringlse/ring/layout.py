"""Sequence layouts across W ranks (CONVENTIONS.md §5) and `shard`/`unshard`.

A layout says which global positions each rank holds. Every layout keeps a rank's positions
increasing in local index, as runs of a fixed stride (`segments`); the ring's plans
(`ringlse.ring.plan`) turn the mask rule into block calls over those runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag", "stripe")


def default_layout(causal: bool) -> str:
    """zigzag balances causal work; contiguous is simplest otherwise."""
    return "zigzag" if causal else "contiguous"


def check_layout(layout: str, seqlen: int, world: int) -> None:
    """Raise ValueError unless a sequence of `seqlen` tokens splits over `world` ranks in `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
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


def segments(layout: str, rank: int, world: int, n_local: int) -> list[Segment]:
    if layout == "contiguous":
        return [Segment(0, n_local, rank * n_local, 1)]
    if layout == "zigzag":
        c = n_local // 2
        return [Segment(0, c, rank * c, 1), Segment(c, c, (2 * world - 1 - rank) * c, 1)]
    if layout == "stripe":
        return [Segment(0, n_local, rank, world)]
    raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")


def local_positions(layout: str, rank: int, world: int, n_local: int) -> torch.Tensor:
    """Global positions held by `rank`, in local order: `[n_local]` int64."""
    return torch.cat([
        s.global_start + s.stride * torch.arange(s.length) for s in segments(layout, rank, world, n_local)
    ])


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, layout: str, dim: int = 1, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's part of a full sequence held by every rank.

    Args:
        x: the full tensor (same on every rank); sequence along `dim` of length S.
        layout: `contiguous`, `zigzag` or `stripe`.
        dim: the sequence dimension.
        group: process group (default: the world; without torch.distributed, one rank).

    Returns:
        The local shard, length `S / W` along `dim` (a contiguous tensor).

    Raises:
        ValueError: S does not divide over W in `layout` (before any communication).
    """
    rank, world = _group_info(group)
    seqlen = x.shape[dim]
    check_layout(layout, seqlen, world)
    n = seqlen // world
    pos = local_positions(layout, rank, world, n).to(x.device)
    return x.index_select(dim, pos)


def unshard(x_local: torch.Tensor, layout: str, dim: int = 1, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Gather every rank's shard and put the tokens back in sequence order (inverse of `shard`).

    Args:
        x_local: this rank's shard, length `n` along `dim` (same shape on every rank).
        layout, dim, group: as in `shard`.

    Returns:
        The full tensor, length `n * W` along `dim`, on every rank.
    """
    rank, world = _group_info(group)
    n = x_local.shape[dim]
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


