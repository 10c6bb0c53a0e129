"""The ring's step plans, checked exhaustively against global positions: every visible (query, key)
pair is covered exactly once, nothing invisible is attended, and the backward's split of the own
block into two halves of keys, and the backward's pieces of keys for dk/dv messages, cover the same set."""

from __future__ import annotations

import itertools

import pytest
import torch

from ringlse.ring.layout import LAYOUTS, local_positions
from ringlse.ring.plan import plan_step
from ringlse.masks import BlockKind, block_kind, visibility_mask
from ringlse.ring.plan import key_pieces, key_span, piece_size, split_keys


def _covered(calls, n: int) -> torch.Tensor:
    """How many times each local (query, key) pair is attended by `calls` (causal calls by their mask)."""
    count = torch.zeros(n, n, dtype=torch.int64)
    for c in calls:
        assert 0 <= c.q0 < c.q1 <= n and 0 <= c.k0 < c.k1 <= n
        assert block_kind(c.q1 - c.q0, c.k1 - c.k0, c.q_start, c.k_start, c.causal) is not BlockKind.EMPTY
        if c.causal:
            seen = visibility_mask(c.q1 - c.q0, c.k1 - c.k0, c.q_start, c.k_start)
        else:
            seen = torch.ones(c.q1 - c.q0, c.k1 - c.k0, dtype=torch.bool)
        count[c.q0:c.q1, c.k0:c.k1] += seen.long()
    return count


def _truth(layout: str, rank: int, src: int, world: int, n: int, causal: bool) -> torch.Tensor:
    pq, pk = local_positions(layout, rank, world, n), local_positions(layout, src, world, n)
    if not causal:
        return torch.ones(n, n, dtype=torch.int64)
    return (pk[None, :] <= pq[:, None]).long()


CASES = [(layout, world, n, causal) for layout, world, n, causal in
         itertools.product(LAYOUTS, (1, 2, 3, 4), (2, 6, 10), (False, True))]


@pytest.mark.parametrize("layout,world,n,causal", CASES, ids=lambda x: str(x))
def test_plan_covers_visible_pairs_exactly_once(layout, world, n, causal):
    for rank, src in itertools.product(range(world), repeat=2):
        plan = plan_step(layout, rank, src, world, n, causal)
        assert torch.equal(_covered(plan, n), _truth(layout, rank, src, world, n, causal)), (rank, src)


@pytest.mark.parametrize("layout,world,n,causal", CASES, ids=lambda x: str(x))
def test_split_keys_partitions_the_own_block(layout, world, n, causal):
    for rank in range(world):
        plan = plan_step(layout, rank, rank, world, n, causal)
        for m in range(n + 1):
            first, last = split_keys(plan, m)
            assert all(c.k1 <= m for c in first) and all(c.k0 >= m for c in last)
            assert torch.equal(_covered(first + last, n), _covered(plan, n)), (rank, m)


@pytest.mark.parametrize("layout,world,n,causal", [(lay, w, n, c) for lay, w, n, c in
                                                   itertools.product(LAYOUTS, (3, 4), (130, 150, 256, 1000),
                                                                     (False, True))],
                         ids=lambda x: str(x))
def test_key_pieces_partition_every_step(layout, world, n, causal):
    """Pieces of at most `piece_size` keys (n / 4 rounded up to a tile: what a copy-engine dk/dv message
    slot holds, `ringlse.ring.dkv_pull`), each within one such cut, in key order, none empty, covering
    each step's pairs exactly as its plan does."""
    size = piece_size(n, 4)
    assert size % 64 == 0 and size >= n / 4 and size - 64 < max(n / 4, 64)
    for rank, src in itertools.product(range(world), repeat=2):
        plan = plan_step(layout, rank, src, world, n, causal)
        pieces = key_pieces(plan, n, 4)
        assert all(pieces) and sum(map(len, pieces)) >= len(plan)
        bounds = [key_span(p) for p in pieces]
        assert all(lo // size == (hi - 1) // size for lo, hi in bounds), bounds
        assert all(a[1] <= b[0] for a, b in zip(bounds, bounds[1:])), bounds
        assert torch.equal(_covered([c for p in pieces for c in p], n), _covered(plan, n)), (rank, src)
