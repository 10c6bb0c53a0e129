"""The causal position rule (CONVENTIONS.md §4): `visibility_mask`, `block_kind`, `split_causal_block` and
`split_causal_block_top_left`.

Everything is checked exhaustively on small sizes against a brute-force Python statement of the rule,
`k_start + j <= q_start + i`, so a wrong offset sign or an off-by-one shows up as a concrete cell.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ringlse.masks import (
    BlockKind,
    Piece,
    block_kind,
    split_causal_block,
    split_causal_block_top_left,
    visibility_mask,
)

# (function, most pieces, causal pieces must be square)
SPLITS = [
    pytest.param(split_causal_block, 3, True, id="squares"),
    pytest.param(split_causal_block_top_left, 2, False, id="top-left"),
]

SIZES = [0, 1, 2, 3, 5, 8]
# offsets q_start - k_start from "every query precedes every key" to "every query follows every key"
OFFSETS = list(range(-10, 11)) + [-1000, 1000]
# absolute starts with the same offset must behave identically: only the difference matters
STARTS = [(0, 0), (7, 7), (1000, 1000)]


def brute_visible(sq: int, sk: int, q_start: int, k_start: int) -> set[tuple[int, int]]:
    return {(i, j) for i in range(sq) for j in range(sk) if k_start + j <= q_start + i}


def _cases():
    for sq, sk in itertools.product(SIZES, SIZES):
        yield pytest.param(sq, sk, id=f"sq{sq}-sk{sk}")


@pytest.mark.parametrize(("sq", "sk"), _cases())
def test_visibility_mask_matches_rule(sq, sk):
    for off, (base_q, base_k) in itertools.product(OFFSETS, STARTS):
        q_start, k_start = base_q + max(off, 0), base_k + max(-off, 0)
        m = visibility_mask(sq, sk, q_start, k_start)
        assert m.shape == (sq, sk) and m.dtype == torch.bool
        got = {(i, j) for i, j in m.nonzero().tolist()}
        assert got == brute_visible(sq, sk, q_start, k_start), (sq, sk, q_start, k_start)


def test_visibility_mask_device_argument():
    m = visibility_mask(4, 6, 2, 0, device="meta")
    assert m.device.type == "meta" and m.shape == (4, 6)
    assert visibility_mask(4, 6, 2, 0, device="cpu").device.type == "cpu"


@pytest.mark.parametrize(("sq", "sk"), _cases())
def test_block_kind_agrees_with_mask(sq, sk):
    for off, (base_q, base_k) in itertools.product(OFFSETS, STARTS):
        q_start, k_start = base_q + max(off, 0), base_k + max(-off, 0)
        vis = brute_visible(sq, sk, q_start, k_start)
        if sq == 0 or sk == 0:
            expected = BlockKind.EMPTY
        elif not vis:
            expected = BlockKind.EMPTY
        elif len(vis) == sq * sk:
            expected = BlockKind.FULL
        else:
            expected = BlockKind.PARTIAL
        assert block_kind(sq, sk, q_start, k_start, True) is expected, (sq, sk, q_start, k_start)
        # without a mask a block is full unless it has no rows or no keys
        nc = block_kind(sq, sk, q_start, k_start, False)
        assert nc is (BlockKind.EMPTY if sq == 0 or sk == 0 else BlockKind.FULL)


@pytest.mark.parametrize(
    ("sq", "sk", "q_start", "k_start", "kind"),
    [
        pytest.param(4, 4, 0, 0, BlockKind.PARTIAL, id="diagonal"),
        pytest.param(4, 4, 4, 0, BlockKind.FULL, id="below-diagonal"),
        pytest.param(4, 4, 0, 4, BlockKind.EMPTY, id="above-diagonal"),
        pytest.param(4, 4, 0, 1, BlockKind.PARTIAL, id="stripe-k_start-1"),
        pytest.param(97, 33, 64, 0, BlockKind.FULL, id="bottom-right-97x33"),
        pytest.param(33, 97, 0, 0, BlockKind.PARTIAL, id="top-left-33x97"),
        pytest.param(1, 1025, 1024, 0, BlockKind.FULL, id="decode-1x1025"),
        pytest.param(3, 5, 0, 2, BlockKind.PARTIAL, id="last-row-sees-one"),
        pytest.param(3, 5, 0, 3, BlockKind.EMPTY, id="last-row-sees-none"),
    ],
)
def test_block_kind_named_cases(sq, sk, q_start, k_start, kind):
    assert block_kind(sq, sk, q_start, k_start, True) is kind


def _check_pieces(sq: int, sk: int, q_start: int, k_start: int, pieces: list[Piece], most: int, square: bool) -> None:
    vis = brute_visible(sq, sk, q_start, k_start)
    covered: list[tuple[int, int]] = []
    assert len(pieces) <= most
    for p in pieces:
        assert isinstance(p, Piece)
        # a piece is a non-empty rectangle inside the block
        assert 0 <= p.q0 < p.q1 <= sq and 0 <= p.k0 < p.k1 <= sk, p
        if p.causal:
            # a plain kernel's top-left causal mask: local key j visible iff j <= i
            assert not square or p.q1 - p.q0 == p.k1 - p.k0, p
            covered += [(p.q0 + i, p.k0 + j) for i in range(p.q1 - p.q0) for j in range(min(i + 1, p.k1 - p.k0))]
        else:
            covered += [(i, j) for i in range(p.q0, p.q1) for j in range(p.k0, p.k1)]
    # exactly the visible set, and no cell twice (a cell counted twice would be merged twice)
    assert len(covered) == len(set(covered)), ("overlap", pieces)
    assert set(covered) == vis, ("cover", pieces)


@pytest.mark.parametrize(("split", "most", "square"), SPLITS)
@pytest.mark.parametrize(("sq", "sk"), _cases())
def test_split_causal_block_covers_visible_set_exactly(sq, sk, split, most, square):
    for off, (base_q, base_k) in itertools.product(OFFSETS, STARTS):
        q_start, k_start = base_q + max(off, 0), base_k + max(-off, 0)
        pieces = split(sq, sk, q_start, k_start)
        _check_pieces(sq, sk, q_start, k_start, pieces, most, square)
        if not brute_visible(sq, sk, q_start, k_start):
            assert pieces == []


@pytest.mark.parametrize(
    ("sq", "sk", "q_start", "k_start"),
    [
        pytest.param(97, 97, 0, 0, id="diag-97"),
        pytest.param(97, 33, 10, 0, id="97x33-off10"),
        pytest.param(33, 97, 0, 40, id="33x97-negoff"),
        pytest.param(1025, 7, 0, 3, id="1025x7"),
        pytest.param(7, 1025, 500, 0, id="7x1025-mid"),
    ],
)
@pytest.mark.parametrize(("split", "most", "square"), SPLITS)
def test_split_causal_block_awkward_sizes(sq, sk, q_start, k_start, split, most, square):
    # too big for the set-based check: compare coverage counts as tensors instead
    count = torch.zeros(sq, sk, dtype=torch.int32)
    pieces = split(sq, sk, q_start, k_start)
    assert len(pieces) <= most
    for p in pieces:
        blk = torch.ones(p.q1 - p.q0, p.k1 - p.k0, dtype=torch.int32)
        if p.causal:
            assert not square or p.q1 - p.q0 == p.k1 - p.k0
            blk = torch.tril(blk)
        count[p.q0 : p.q1, p.k0 : p.k1] += blk
    assert torch.equal(count, visibility_mask(sq, sk, q_start, k_start).to(torch.int32))
