"""The ring's per-step block plans and K/V routes over the ranks' position runs (`ringlse.ring.layout`).

The ring only needs a layout's runs (`segments`) to turn the mask rule into block calls with local
offsets (`plan_step`, `plan_step_masked`), and the key rows each step reads (`kv_route`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ringlse.blocks.calls import BlockCall
from ringlse.blocks.contract import Masks
from ringlse.mask_calls import rule_calls
from ringlse.masks import BlockKind, Intervals, Rule, Runs, Span, block_kind, planned_intervals
from ringlse.ring.layout import Balanced, Layout, Segment, segments


def _span(seg: Segment) -> Span:
    return Span(seg.global_start, seg.length, seg.stride)


class Rows(NamedTuple):
    """Local rows `[local_start, local_start + span.length)` at the positions of `span`: one side of a
    masked block call."""

    local_start: int
    span: Span | Runs

    def cut(self, a: int, b: int) -> Rows:
        """Its rows `[a, b)` (local to it)."""
        return Rows(self.local_start + a, self.span.cut(a, b))


@functools.lru_cache(maxsize=64)
def _rows(layout: Layout, rank: int, world: int, n_local: int) -> tuple[Rows, ...]:
    """`rank`'s rows as the units a masked step calls at once: each run of a fixed-stride layout apart
    (one or two), a balanced rank's runs all together, so that its step is one call however many runs
    it holds (the per-row intervals stay exact: its positions increase throughout)."""
    segs = segments(layout, rank, world, n_local)
    if isinstance(layout, Balanced):
        return (Rows(0, Runs(tuple(_span(s) for s in segs))),)
    return tuple(Rows(s.local_start, _span(s)) for s in segs)


@functools.lru_cache(maxsize=32)
def _query_units(layout: Layout, rank: int, world: int, n_local: int, rule: Rule
                 ) -> tuple[tuple[Rows, torch.Tensor, torch.Tensor], ...]:
    """`rank`'s row units with the global keys `[lo, hi)` each of their queries sees: the same against
    every peer, so computed once per packing and rank, not once per step and peer (the plans of a new
    packing of 256K tokens on 8 ranks asked for them 2W + W(W-1) times per rank)."""
    return tuple((qs, *rule.key_bounds(qs.span.positions())) for qs in _rows(layout, rank, world, n_local))


def _visible_parts(layout: Layout, rank: int, src: int, world: int, n_local: int, rule: Rule
                   ) -> list[tuple[Rows, Rows]]:
    """For each pair of row units (`_rows`: query rows of `rank` x key rows of `src`) that shows any
    pair: the query rows that see any of its keys and the key rows they see, first to last, as the
    two units cut to them. From the keys each query sees alone (the cheaper half of `block_intervals`)."""
    parts = []
    for qs, lo, hi in _query_units(layout, rank, world, n_local, rule):
        for ks in _rows(layout, src, world, n_local):
            key_lo, key_hi = ks.span.local(lo), ks.span.local(hi)
            live = key_hi > key_lo
            rows = live.nonzero()
            if rows.numel():
                parts.append((qs.cut(int(rows[0]), int(rows[-1]) + 1),
                              ks.cut(int(key_lo[live].min()), int(key_hi[live].max()))))
    return parts


def _call(qs: Rows, ks: Rows, intervals: Intervals | None = None) -> BlockCall:
    return BlockCall(qs.local_start, qs.local_start + qs.span.length, ks.local_start,
                     ks.local_start + ks.span.length, False, 0, 0, intervals)


def plan_step_masked(layout: Layout, rank: int, src: int, world: int, n_local: int, rule: Rule) -> list[BlockCall]:
    """`plan_step` for a rule with windows or documents: one call per pair of row units (`_rows`: query
    rows of `rank` x key rows of `src`) that shows any pair, through intervals where it is not fully
    visible.

    Each call is cut to the query rows that see any of its keys and the key rows any of them sees:
    a window shorter than a run then reads (and the ring moves, `rows_read`) only the rows near the
    boundary, and the kernel skips the rest without a launch over them."""
    calls = []
    for qs, ks in _visible_parts(layout, rank, src, world, n_local, rule):
        iv = planned_intervals(rule, qs.span, ks.span)
        calls.append(_call(qs, ks, iv if iv.kind() is BlockKind.PARTIAL else None))
    return calls


def plan_step_by_rule(layout: Layout, rank: int, src: int, world: int, n_local: int, rule: Rule,
                      masks: Masks) -> list[BlockCall]:
    """`plan_step_masked` for ops without intervals (`masks`: `Masks.PLAIN` or `Masks.WINDOW`), in
    layouts of contiguous runs: per pair of runs (query run of `rank` x key run of `src`), one plain
    call per document, a window as a rule, as on one device (`ringlse.mask_calls.rule_calls`)."""
    calls = []
    for qs in segments(layout, rank, world, n_local):
        for ks in segments(layout, src, world, n_local):
            calls += rule_calls(masks, "", rule, qs.local_start, qs.local_start + qs.length, ks.local_start,
                                ks.local_start + ks.length, qs.global_start, ks.global_start, "ring_attention")
    return calls


def rows_read(plan: Sequence[BlockCall]) -> tuple[int, int]:
    """The key rows `[k0, k1)` a step's calls read (empty when it has none)."""
    return (min(c.k0 for c in plan), max(c.k1 for c in plan)) if plan else (0, 0)


def plan_step(layout: Layout, rank: int, src: int, world: int, n_local: int, causal: bool) -> list[BlockCall]:
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


def _step(layout: Layout, world: int, n: int, rule: Rule, masks: Masks):
    """`step(rank, src)`: the calls attending `rank`'s queries to `src`'s keys, for an op taking `masks`."""
    if rule.plain:
        return lambda r, src: plan_step(layout, r, src, world, n, rule.causal)
    if masks is Masks.INTERVALS:
        return lambda r, src: plan_step_masked(layout, r, src, world, n, rule)
    return lambda r, src: plan_step_by_rule(layout, r, src, world, n, rule, masks)


@functools.lru_cache(maxsize=64)
def step_plans(layout: Layout, rank: int, world: int, n: int, rule: Rule, masks: Masks = Masks.INTERVALS
               ) -> tuple[tuple[tuple[BlockCall, ...], ...], ...]:
    """`(plans, peer_plans)`: plans[s] are the block calls of step s, whose K/V came from rank
    (rank - s) mod W; peer_plans[s] those of rank (rank + s) mod W at its step s, when it holds our
    K/V, for an op taking `masks`. Cached: the same shapes come back on every call of a training run."""
    step = _step(layout, world, n, rule, masks)
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
def kv_route(layout: Layout, world: int, n: int, rule: Rule, masks: Masks = Masks.INTERVALS) -> Route:
    """The `Route` of a ring of `world` ranks holding `n` tokens each in `layout` under `rule`,
    from every rank's plans (each rank computes the same). Cached like `step_plans`.

    A plain rule (causal or none) has rank W-1 read every step in full: neighbour passing, the
    overlap design of `ringlse.ring.forward`. A window or documents may leave steps unread and rows
    unseen; direct sends then move only what is read, but to peers r +- s, which across hosts
    cross more links than neighbours do: taken where they skip a whole step or move at most half
    the rows (otherwise every step is read, and neighbour passing runs them all)."""
    if rule.plain or world == 1:
        return Route(tuple(range(1, world)), False)
    rows = [[_rows_read(layout, r, (r - s) % world, world, n, rule, masks) for s in range(1, world)]
            for r in range(world)]
    steps = tuple(s for s in range(1, world) if any(read[s - 1][1] > read[s - 1][0] for read in rows))
    moved = sum(k1 - k0 for read in rows for k0, k1 in read)
    return Route(steps, len(steps) < world - 1 or 2 * moved <= world * (world - 1) * n)


def _rows_read(layout: Layout, rank: int, src: int, world: int, n: int, rule: Rule, masks: Masks) -> tuple[int, int]:
    """The key rows of `src` that `rank`'s step calls read, the only ones direct sends move: for ops with
    intervals, those of the visible parts (their calls, without building the intervals); else those of
    the plain calls, which may read keys no query sees (a causal block's keys past its last query)."""
    if masks is Masks.INTERVALS:
        return rows_read([_call(*part) for part in _visible_parts(layout, rank, src, world, n, rule)])
    return rows_read(plan_step_by_rule(layout, rank, src, world, n, rule, masks))


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
        if c.intervals is not None or c.window is not None:  # masked calls stay whole, in the half computed first
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
