"""The causal-mask position rule of CONVENTIONS.md §4, shared by every block op.

Key `j` is visible to query `i` iff `k_start + j <= q_start + i`; only the difference
`offset = q_start - k_start` matters, so a block is visible iff `j <= i + offset`.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

import torch


class BlockKind(Enum):
    EMPTY = "empty"  # no query sees any key: skip the block
    FULL = "full"  # every query sees every key: run without a mask
    PARTIAL = "partial"  # a real causal boundary runs through the block


def visibility_mask(
    seqlen_q: int, seqlen_k: int, q_start: int, k_start: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """`[seqlen_q, seqlen_k]` bool, True where key `j` is visible to query `i` under causal masking."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return k_start + j <= q_start + i


def block_kind(seqlen_q: int, seqlen_k: int, q_start: int, k_start: int, causal: bool) -> BlockKind:
    """Classify a block so that callers skip empty ones and drop the mask from full ones."""
    if seqlen_q == 0 or seqlen_k == 0:
        return BlockKind.EMPTY
    if not causal:
        return BlockKind.FULL
    offset = q_start - k_start
    if seqlen_q - 1 + offset < 0:  # even the last query precedes the first key
        return BlockKind.EMPTY
    if seqlen_k - 1 <= offset:  # even the first query follows the last key
        return BlockKind.FULL
    return BlockKind.PARTIAL


class Piece(NamedTuple):
    """A rectangle `q[q0:q1] x k[k0:k1]` that is either fully visible or top-left causal (key j
    visible to query i iff j <= i, local to the piece): a square from `split_causal_block`, any shape
    from `split_causal_block_top_left`."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def split_causal_block(seqlen_q: int, seqlen_k: int, q_start: int, k_start: int) -> list[Piece]:
    """Cover the visible part of a causal block with at most three pieces a plain kernel can run.

    Backends that only know "no mask" and "top-left causal on a square" (PyTorch SDPA, flash-attn)
    still serve any offset this way. Rows before `i0` see nothing and are left out (their state
    stays `(0, -inf)`).
    """
    offset = q_start - k_start
    i0 = max(0, -offset)  # first query that sees any key
    if i0 >= seqlen_q:
        return []
    # row i sees keys j <= i + offset, so keys [0, offset) are seen by every live row, and from key
    # `offset` on (row i0, key max(offset, 0)) the boundary is a top-left causal square
    full_keys = min(seqlen_k, max(offset, 0))
    pieces: list[Piece] = []
    if full_keys > 0:
        pieces.append(Piece(i0, seqlen_q, 0, full_keys, False))
    diag = min(seqlen_q - i0, seqlen_k - full_keys)
    if diag > 0:
        pieces.append(Piece(i0, i0 + diag, full_keys, full_keys + diag, True))
        # rows past the square see every remaining key
        if i0 + diag < seqlen_q and full_keys + diag == seqlen_k:
            pieces.append(Piece(i0 + diag, seqlen_q, full_keys, seqlen_k, False))
    return pieces


def split_causal_block_top_left(seqlen_q: int, seqlen_k: int, q_start: int, k_start: int) -> list[Piece]:
    """Cover the visible part of a causal block with at most two pieces, for kernels whose causal mask
    is top-left aligned on any shape (PyTorch's cuDNN, memory-efficient and math kernels): the keys
    every live row sees, then one top-left causal piece of the rest (rows past its diagonal see all
    of its keys, as top-left alignment has it). Rows before `i0` see nothing and are left out."""
    offset = q_start - k_start
    i0 = max(0, -offset)
    if i0 >= seqlen_q:
        return []
    full_keys = min(seqlen_k, max(offset, 0))  # row i0 + r sees keys j <= full_keys + r
    pieces: list[Piece] = []
    if full_keys > 0:
        pieces.append(Piece(i0, seqlen_q, 0, full_keys, False))
    if full_keys < seqlen_k:
        pieces.append(Piece(i0, seqlen_q, full_keys, seqlen_k, True))
    return pieces
