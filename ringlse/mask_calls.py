"""Block calls under a mask rule (CONVENTIONS.md §10) for rows and keys at contiguous positions: one
call through intervals for ops that take them, else one plain call per document (a window as a rule
for ops that take it). Single-device plans (`ringlse.attention_plan`) and the ring's plans for ops
without intervals (`ringlse.ring.plan`) both cut their blocks here."""

from __future__ import annotations

from collections.abc import Iterator

from ringlse.blocks.calls import BlockCall
from ringlse.blocks.contract import Masks
from ringlse.masks import BlockKind, Rule, Span, block_kind, planned_intervals


def plain_calls(q0: int, q1: int, k0: int, k1: int, causal: bool, q_start: int, k_start: int) -> list[BlockCall]:
    """The block rows `[q0, q1)` x `[k0, k1)` at global `q_start`, `k_start` under plain causal (or no)
    masking: nothing, or one call (causal only where the boundary crosses it)."""
    kind = block_kind(q1 - q0, k1 - k0, q_start, k_start, causal)
    if kind is BlockKind.EMPTY:
        return []
    partial = kind is BlockKind.PARTIAL
    return [BlockCall(q0, q1, k0, k1, partial, q_start if partial else 0, k_start if partial else 0)]


def rule_calls(masks: Masks, op_name: str, rule: Rule, q0: int, q1: int, k0: int, k1: int, q_start: int,
               k_start: int, what: str) -> Iterator[BlockCall]:
    """Calls covering rows `[q0, q1)` (global positions from `q_start`) x keys `[k0, k1)` (from
    `k_start`) under `rule`, for an op whose masks are `masks` (`op_name` in messages): plain calls
    where the rule is plain, else intervals for ops that take them, else one plain call per document
    (windows as a rule for ops with `Masks.WINDOW`; other ops raise ValueError)."""
    if rule.plain:
        yield from plain_calls(q0, q1, k0, k1, rule.causal, q_start, k_start)
        return
    if masks is Masks.INTERVALS:
        iv = planned_intervals(rule, Span(q_start, q1 - q0), Span(k_start, k1 - k0))
        kind = iv.kind()
        if kind is BlockKind.FULL:
            yield BlockCall(q0, q1, k0, k1, False, 0, 0)
        elif kind is BlockKind.PARTIAL:
            yield BlockCall(q0, q1, k0, k1, False, 0, 0, iv)
        return
    windowed = rule.window != (-1, -1)
    if windowed and masks is not Masks.WINDOW:
        raise ValueError(f"{what}: window_size needs a backend that takes windows; the {op_name!r} block op does not")
    segments = [(q0, q1, k0, k1)]
    if rule.docs is not None:  # each document alone is a block of its own
        segments = [(max(q0, q0 + a - q_start), min(q1, q0 + b - q_start), max(k0, k0 + a - k_start),
                     min(k1, k0 + b - k_start)) for a, b in zip(rule.docs, rule.docs[1:])]
    for qa, qb, ka, kb in segments:
        if qa >= qb or ka >= kb:
            continue
        qs, ks = q_start + qa - q0, k_start + ka - k0
        if not windowed:
            yield from plain_calls(qa, qb, ka, kb, rule.causal, qs, ks)
            continue
        # a window as a rule: cut to the rows that see keys and the keys they see (`fa4_window_pieces`)
        iv = planned_intervals(Rule(rule.causal, rule.window), Span(qs, qb - qa), Span(ks, kb - ka))
        box, kind = iv.box(), iv.kind()
        if box is None:
            continue
        if kind is BlockKind.FULL:
            yield BlockCall(qa, qb, ka, kb, False, 0, 0)
            continue
        r0, r1, c0, c1 = box
        yield BlockCall(qa + r0, qa + r1, ka + c0, ka + c1, rule.causal, qs + r0, ks + c0, window=rule.window)
