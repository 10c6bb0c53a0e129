"""Which chunks of a packed sequence each rank holds in the `balanced` layout (CONVENTIONS.md §5): the
same number of tokens per rank and, within a few percent, the same causal work under the documents.

The sequence is cut into chunks of `chunk_size` tokens; a chunk's work is the number of (query, key)
pairs its queries see under causal masking and the documents (`ringlse.masks.visible_per_position`,
the measure of `ringlse.ring.layout.rank_work`). The chunks are put in an order, and each rank in turn
takes a run from each end of what is left of it (`_two_ended`): `a` chunks from the front and `k - a`
from the back, `a` chosen so that the rank's work comes closest to the mean of what is left; the last
rank takes the rest. Two orders are tried, the first kept where it balances within `TOLERANCE`:

- position order: at most two runs per rank (on one document this is zigzag);
- folded documents: each document's chunks as first, last, second, second to last, ... (pairs of
  nearly equal work, as in zigzag), documents by increasing work per chunk. Work then rises along the
  order, so every rank gets within about one chunk's work of the mean, at the price of more runs
  (a rank holds several short documents whole, from wherever they lie).

A rank's chunks are then sorted by position (the ring's plans need positions increasing in local
index) and merged into runs. Everything here is a function of `(docs, world)`: every rank computes
the same assignment without communicating. Why this and not others: docs/decisions.md.
"""

from __future__ import annotations

import functools
from itertools import accumulate

import torch

from ringlse.masks import Rule, visible_per_position

# Chunk length: the kernels' query tile (runs then never share a tile), or half of it where the
# sequence is not a multiple of 128 tokens per rank.
CHUNK, MIN_CHUNK = 128, 64
# Position order is kept where its busiest rank has at most this much more work than the mean.
TOLERANCE = 1.02


def chunk_size(seqlen: int, world: int) -> int | None:
    """Tokens per chunk for `seqlen` tokens over `world` ranks (every rank holds the same number of
    chunks), or None where the length does not divide (not a multiple of `MIN_CHUNK * world`)."""
    for c in (CHUNK, MIN_CHUNK):
        if seqlen % (c * world) == 0:
            return c
    return None


def chunk_work(docs: tuple[int, ...], chunk: int) -> list[int]:
    """Visible (query, key) pairs of each chunk's queries under causal masking and `docs` (length `docs[-1]`)."""
    per_position = visible_per_position(Rule(True, docs=docs), docs[-1])
    return per_position.view(-1, chunk).sum(1).tolist()


@functools.lru_cache(maxsize=16)
def assign(docs: tuple[int, ...], world: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The `balanced` layout of the sequence `[0, docs[-1])` with document boundaries `docs`.

    Args:
        docs: document boundaries `(0, ..., S)`; `S` a multiple of `MIN_CHUNK * world`.
        world: the number of ranks W.

    Returns:
        Per rank, its runs `(first position, length)` in increasing position order; every rank's
        lengths sum to `S / W`. Cached: a training step's every layer asks for the same packing.
    """
    chunk = chunk_size(docs[-1], world)
    if chunk is None:
        raise ValueError(f"balanced layout: sequence length {docs[-1]} is not a multiple of {MIN_CHUNK}·W = "
                         f"{MIN_CHUNK * world}")
    work = chunk_work(docs, chunk)
    best, best_ratio = None, float("inf")
    for order in (list(range(len(work))), _folded(work, docs, chunk)):
        parts = _two_ended(work, order, world)
        ratio = _imbalance(work, parts)
        if ratio < best_ratio:
            best, best_ratio = parts, ratio
        if ratio <= TOLERANCE:  # fewer runs where balance allows
            break
    return tuple(_runs(sorted(p), chunk) for p in best)


def _two_ended(work: list[int], order: list[int], world: int) -> list[list[int]]:
    """Each rank but the last takes `a` chunks from the front of what is left of `order` and `k - a`
    from its back, `a` bringing its work closest to the mean of what is left; the last takes the rest."""
    k = len(order) // world
    w = [work[i] for i in order]
    lo, hi, left = 0, len(order), sum(work)
    parts = []
    for r in range(world - 1):
        front = list(accumulate(w[lo:lo + k], initial=0))
        back = list(accumulate(reversed(w[hi - k:hi]), initial=0))
        # |work - left / ranks_left| in integers (exact, so every rank picks the same `a`)
        a = min(range(k + 1), key=lambda a: abs((front[a] + back[k - a]) * (world - r) - left))
        parts.append(order[lo:lo + a] + order[hi - (k - a):hi])
        left -= front[a] + back[k - a]
        lo, hi = lo + a, hi - (k - a)
    parts.append(order[lo:hi])
    return parts


def _folded(work: list[int], docs: tuple[int, ...], chunk: int) -> list[int]:
    """Chunks by document (the one holding a chunk's middle token), each document folded (first, last,
    second, second to last, ...), documents by increasing work per chunk, ties in position order."""
    middles = torch.arange(len(work)) * chunk + chunk // 2
    owner = (torch.searchsorted(torch.tensor(docs), middles, right=True) - 1).tolist()
    groups: dict[int, list[int]] = {}
    for i, d in enumerate(owner):
        groups.setdefault(d, []).append(i)
    folded = []
    for chunks in groups.values():
        order = [c for pair in zip(chunks, reversed(chunks)) for c in pair][:len(chunks)]
        folded.append((sum(work[c] for c in chunks) / len(chunks), chunks[0], order))
    folded.sort(key=lambda f: f[:2])
    return [c for *_, order in folded for c in order]


def _imbalance(work: list[int], parts: list[list[int]]) -> float:
    per_rank = [sum(work[i] for i in p) for p in parts]
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0


def _runs(chunks: list[int], chunk: int) -> tuple[tuple[int, int], ...]:
    """Sorted chunk indices as maximal runs `(first position, length)`."""
    runs: list[list[int]] = []
    for c in chunks:
        if runs and runs[-1][0] + runs[-1][1] == c * chunk:
            runs[-1][1] += chunk
        else:
            runs.append([c * chunk, chunk])
    return tuple((a, n) for a, n in runs)
