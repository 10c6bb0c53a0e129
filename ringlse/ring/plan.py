"""Sequence layouts across W ranks (CONVENTIONS.md §5), `shard`/`unshard`, and the per-step block plan.

A layout says which global positions each rank holds. Every layout keeps a rank's positions
increasing in local index, as one or two runs of a fixed stride; the ring only needs those runs
(`segments`) to turn the causal rule into block calls with local offsets (`plan_step`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ringlse.blocks.calls import BlockCall
from ringlse.masks import BlockKind, Intervals, Rule, Span, block_kind, planned_intervals
from ringlse.ring.head_split import gather_head_pieces, head_piece

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


def _span(seg: Segment) -> Span:
    return Span(seg.global_start, seg.length, seg.stride)


def _cut(seg: Segment, a: int, b: int) -> Segment:
    """Rows `[a, b)` of a run (local to it)."""
    return Segment(seg.local_start + a, b - a, seg.global_start + a * seg.stride, seg.stride)


def _visible_parts(layout: str, rank: int, src: int, world: int, n_local: int, rule: Rule
                   ) -> list[tuple[Segment, Segment]]:
    """For each pair of position runs (query run of `rank` x key run of `src`) that shows any pair:
    the query rows that see any of its keys and the key rows they see, first to last, as the two
    runs cut to them. From the keys each query sees alone (the cheaper half of `block_intervals`)."""
    parts = []
    for qs in segments(layout, rank, world, n_local):
        for ks in segments(layout, src, world, n_local):
            key_lo, key_hi = (_span(ks).local(x) for x in rule.key_bounds(_span(qs).positions()))
            live = key_hi > key_lo
            rows = live.nonzero()
            if rows.numel():
                parts.append((_cut(qs, int(rows[0]), int(rows[-1]) + 1),
                              _cut(ks, int(key_lo[live].min()), int(key_hi[live].max()))))
    return parts


def _call(qs: Segment, ks: Segment, intervals: Intervals | None = None) -> BlockCall:
    return BlockCall(qs.local_start, qs.local_start + qs.length, ks.local_start, ks.local_start + ks.length,
                     False, 0, 0, intervals)


def plan_step_masked(layout: str, rank: int, src: int, world: int, n_local: int, rule: Rule) -> list[BlockCall]:
    """`plan_step` for a rule with windows or documents: one call per pair of position runs (query run
    of `rank` x key run of `src`) that shows any pair, through intervals where it is not fully visible.

    Each call is cut to the query rows that see any of its keys and the key rows any of them sees:
    a window shorter than a run then reads (and the ring moves, `rows_read`) only the rows near the
    boundary, and the kernel skips the rest without a launch over them."""
    calls = []
    for qs, ks in _visible_parts(layout, rank, src, world, n_local, rule):
        iv = planned_intervals(rule, _span(qs), _span(ks))
        calls.append(_call(qs, ks, iv if iv.kind() is BlockKind.PARTIAL else None))
    return calls


def rows_read(plan: Sequence[BlockCall]) -> tuple[int, int]:
    """The key rows `[k0, k1)` a step's calls read (empty when it has none)."""
    return (min(c.k0 for c in plan), max(c.k1 for c in plan)) if plan else (0, 0)


def plan_step(layout: str, rank: int, src: int, world: int, n_local: int, causal: bool) -> list[BlockCall]:
    """The block calls that attend `rank`'s queries to the keys of rank `src`, empty blocks left out.

    Two runs of stride `d` starting at global `gq`, `gk` compare as `gk + j*d <= gq + i*d`, i.e.
    `j <= i + floor((gq - gk) / d)`: a causal block with `q_start = floor((gq - gk) / d)`, `k_start = 0`
    in local indices. (For stripe this is CONVENTIONS.md §4's `k_start = 1` when `src` is after `rank`.)
    """
    if not causal:
        return [BlockCall(0, n_local, 0, n_local, False, 0, 0)]
    if src == rank:
        # same positions on both sides, increasing in local index: pos_j <= pos_i  <=>  j <= i
        return [BlockCall(0, n_local, 0, n_local, True, 0, 0)]
    qsegs, ksegs = segments(layout, rank, world, n_local), segments(layout, src, world, n_local)
    pairs = []
    for qs in qsegs:
        for ks in ksegs:
            offset = (qs.global_start - ks.global_start) // qs.stride
            pairs.append((qs, ks, offset, block_kind(qs.length, ks.length, offset, 0, True)))
    if any(kind is BlockKind.PARTIAL for *_, kind in pairs):
        return [
            BlockCall(qs.local_start, qs.local_start + qs.length, ks.local_start, ks.local_start + ks.length,
                      True, offset, 0)
            for qs, ks, offset, kind in pairs if kind is not BlockKind.EMPTY
        ]
    # Only full and empty pairs: give each query run its visible keys as one range, then join
    # neighbouring query runs that see the same range (zigzag off-diagonal steps become one call).
    calls: list[BlockCall] = []
    for qs in qsegs:
        seen = [ks for q, ks, _, kind in pairs if q == qs and kind is BlockKind.FULL]
        if not seen:
            continue
        k0, k1 = seen[0].local_start, seen[-1].local_start + seen[-1].length
        if sum(ks.length for ks in seen) != k1 - k0:  # not one range: one call per key run
            calls += [BlockCall(qs.local_start, qs.local_start + qs.length, ks.local_start,
                                ks.local_start + ks.length, False, 0, 0) for ks in seen]
            continue
        last = calls[-1] if calls else None
        if last is not None and (last.k0, last.k1) == (k0, k1) and last.q1 == qs.local_start:
            calls[-1] = last._replace(q1=qs.local_start + qs.length)
        else:
            calls.append(BlockCall(qs.local_start, qs.local_start + qs.length, k0, k1, False, 0, 0))
    return calls


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, layout: str, dim: int = 1, group: dist.ProcessGroup | None = None,
          head_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's part of a full sequence held by every rank.

    Args:
        x: the full tensor (same on every rank); sequence along `dim` of length S.
        layout: `contiguous`, `zigzag` or `stripe`.
        dim: the sequence dimension.
        group: process group (default: the world; without torch.distributed, one rank).
        head_group: with head parallelism (`ring_attention(head_group=...)`), the U ranks that hold one
            ring part: it is cut, in the order it holds its tokens, into U contiguous pieces, piece i
            to head-group rank i (CONVENTIONS.md §5.1): the shard is `S / (W·U)` long; a ring part
            that does not split into U pieces raises ValueError before any communication.

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
    pos = head_piece(pos, head_group, seqlen)
    return x.index_select(dim, pos)


def unshard(x_local: torch.Tensor, layout: str, dim: int = 1, group: dist.ProcessGroup | None = None,
            head_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Gather every rank's shard and put the tokens back in sequence order (inverse of `shard`).

    Args:
        x_local: this rank's shard, length `n` along `dim` (same shape on every rank).
        layout, dim, group: as in `shard`.
        head_group: as in `shard`; the pieces of each ring part are gathered first (`n * W * U` long).

    Returns:
        The full tensor, length `n * W` along `dim`, on every rank.
    """
    x_local = gather_head_pieces(x_local, dim, head_group)
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


@functools.lru_cache(maxsize=64)
def step_plans(layout: str, rank: int, world: int, n: int, rule: Rule) -> tuple[tuple[tuple[BlockCall, ...], ...], ...]:
    """`(plans, peer_plans)`: plans[s] are the block calls of step s, whose K/V came from rank
    (rank - s) mod W; peer_plans[s] those of rank (rank + s) mod W at its step s, when it holds our
    K/V. Cached: the same shapes come back on every call of a training run."""
    if rule.plain:
        step = lambda r, src: plan_step(layout, r, src, world, n, rule.causal)  # noqa: E731
    else:
        step = lambda r, src: plan_step_masked(layout, r, src, world, n, rule)  # noqa: E731
    plans = tuple(tuple(step(rank, (rank - s) % world)) for s in range(world))
    peer_plans = tuple(tuple(step((rank + s) % world, rank)) for s in range(world))
    return plans, peer_plans


class Route(NamedTuple):
    """How the K/V of one ring call travel (the same on every rank).

    `steps`: the ring steps s >= 1 at which some rank reads K/V (step s: rank r reads rank (r - s) mod
    W's); no K/V moves at the others. `direct`: each block goes straight from its owner to its
    reader, only the rows that reader's calls read (`rows_read`), instead of whole blocks passed
    from neighbour to neighbour."""

    steps: tuple[int, ...]
    direct: bool


@functools.lru_cache(maxsize=64)
def kv_route(layout: str, world: int, n: int, rule: Rule) -> Route:
    """The `Route` of a ring of `world` ranks holding `n` tokens each in `layout` under `rule`,
    from every rank's plans (each rank computes the same). Cached like `step_plans`.

    A plain rule (causal or none) has rank W-1 read every step in full: neighbour passing, the
    overlap design of `ringlse.ring.forward`. A window or documents may leave steps unread and rows
    unseen; direct sends then move only what is read, but to peers r +- s, which across hosts
    cross more links than neighbours do: taken where they skip a whole step or move at most half
    the rows (otherwise every step is read, and neighbour passing runs them all)."""
    if rule.plain or world == 1:
        return Route(tuple(range(1, world)), False)
    rows = [[rows_read([_call(*part) for part in _visible_parts(layout, r, (r - s) % world, world, n, rule)])
             for s in range(1, world)] for r in range(world)]
    steps = tuple(s for s in range(1, world) if any(read[s - 1][1] > read[s - 1][0] for read in rows))
    moved = sum(k1 - k0 for read in rows for k0, k1 in read)
    return Route(steps, len(steps) < world - 1 or 2 * moved <= world * (world - 1) * n)


def split_keys(plan: Sequence[BlockCall], m: int) -> tuple[list[BlockCall], list[BlockCall]]:
    """The calls of `plan` restricted to local keys `[0, m)` and `[m, n)`, query rows trimmed to those
    that see any of them (a causal piece may become full or vanish).

    The backward splits its own block by keys, not by query rows: the causal own block's first half
    of keys is then one top-left causal call of all rows (rows past the diagonal see every key), and
    its second half the square below the diagonal, so the fused kernels that take top-left masks of
    any shape (cuDNN) return one dk/dv part per key from the own block where a split by rows gave two
    (fewer rounded parts to sum, and one call fewer)."""
    halves: tuple[list[BlockCall], list[BlockCall]] = ([], [])
    for c in plan:
        if c.intervals is not None:  # masked calls stay whole, in the half computed first
            halves[1].append(c)
            continue
        for half, (a, b) in zip(halves, ((c.k0, min(c.k1, m)), (max(c.k0, m), c.k1))):
            if a >= b:
                continue
            k_start = c.k_start + (a - c.k0)
            q0 = c.q0
            if c.causal:  # row i sees local key j iff k_start + j <= q_start + i: skip rows before key a
                q0 = min(c.q1, c.q0 + max(0, k_start - c.q_start))
            q_start = c.q_start + (q0 - c.q0)
            kind = block_kind(c.q1 - q0, b - a, q_start, k_start, c.causal)
            if kind is BlockKind.EMPTY:
                continue
            partial = kind is BlockKind.PARTIAL
            half.append(BlockCall(q0, c.q1, a, b, partial, q_start if partial else 0, k_start if partial else 0))
    return halves


def key_pieces(plan: Sequence[BlockCall], n: int, pieces: int) -> list[list[BlockCall]]:
    """The calls of `plan` (over `n` local keys) cut at every multiple of `ceil(n / pieces)` keys
    (rounded up to 64, a kernel tile), lowest keys first, empty pieces left out (`split_keys` at each
    cut; masked calls stay whole, in the last piece). Every rank computes the same pieces of a plan."""
    size = piece_size(n, pieces)
    out, rest = [], list(plan)
    for m in range(size, n, size):
        piece, rest = split_keys(rest, m)
        if piece:
            out.append(piece)
    return out + ([rest] if rest else [])


def key_span(calls: Sequence[BlockCall]) -> tuple[int, int]:
    """`(k0, k1)`: the keys from the lowest any of `calls` reads to the highest (a piece's dk/dv message)."""
    return min(c.k0 for c in calls), max(c.k1 for c in calls)


def piece_size(n: int, pieces: int) -> int:
    """Keys per piece of `key_pieces`: `ceil(n / pieces)` rounded up to 64 (a kernel tile)."""
    return 64 * max(1, -(-(-(-n // pieces)) // 64))
