"""Which (query, key) pairs are visible: the rule of CONVENTIONS.md §4 and §10, shared by every path.

Plain causal blocks (§4): key `j` is visible to query `i` iff `k_start + j <= q_start + i`; only the
difference `offset = q_start - k_start` matters, so a block is visible iff `j <= i + offset`
(`block_kind`, `visibility_mask`, and the pieces fused kernels can run).

The general rule (§10, `Rule`): the query at global position `p` sees the key at `t` iff
(not causal or `t <= p`) and (`left < 0` or `t >= p - left`) and (`right < 0` or `t <= p + right`) and
`doc(t) == doc(p)`. Every query then sees one interval of keys, and every key is seen by one interval
of queries, both non-decreasing in the position: a block (`Span` of queries x `Span` of keys) is
described by those intervals (`block_intervals`), never by a dense `[S, S]` mask.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
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


# ----------------------------------------------------------------------------------------------------
# the general rule: windows and documents at global positions (CONVENTIONS.md §10)

_FAR = 1 << 62  # beyond any position


def check_window(window_size: Sequence[int], what: str) -> tuple[int, int]:
    """`window_size` as `(left, right)` ints, -1 = unbounded; ValueError names anything else."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"{what}: window_size must be a pair (left, right), got {window_size!r}") from None
    for name, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(f"{what}: window_size {name} must be an int >= -1 (-1: unbounded), got {value!r}")
    return left, right


def check_docs(cu_seqlens: Sequence[int] | torch.Tensor | None, total: int, what: str, *,
               past_end: bool = False) -> tuple[int, ...] | None:
    """Document boundaries `[0, e1, ..., total]` as a tuple (None: one document); ValueError names
    boundaries that do not start at 0, end at `total` (with `past_end`, at `total` or later: a block
    at global positions takes the whole sequence's boundaries), or decrease."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"{what}: cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        bounds = tuple(int(x) for x in cu_seqlens.tolist())
    else:
        bounds = tuple(cu_seqlens)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in bounds):
            raise ValueError(f"{what}: cu_seqlens must hold ints, got {cu_seqlens!r}")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] < total or (bounds[-1] > total and not past_end):
        beyond = " or past it (global boundaries)" if past_end else ""
        raise ValueError(f"{what}: cu_seqlens must run from 0 to the sequence length {total}{beyond}, got {list(bounds)}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{what}: cu_seqlens must not decrease, got {list(bounds)}")
    return bounds


@dataclass(frozen=True)
class Rule:
    """The visibility rule of CONVENTIONS.md §10: causal, a window `(left, right)` (-1 = unbounded) and
    document boundaries `docs` over global positions (None: one document)."""

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    docs: tuple[int, ...] | None = None

    @property
    def plain(self) -> bool:
        """Only causal or nothing: the `block_kind` path serves."""
        return self.window == (-1, -1) and self.docs is None

    def _doc_span(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bounds = torch.tensor(self.docs, dtype=torch.int64, device=x.device)
        # the last boundary <= x starts x's document (empty documents share boundaries: right=True
        # picks the last of them, whose document is the non-empty one holding x)
        i = torch.searchsorted(bounds, x, right=True).clamp(1, len(self.docs) - 1) - 1
        return bounds[i], bounds[i + 1]

    def key_bounds(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global keys `[lo, hi)` seen by the queries at global positions `p` (int64)."""
        lo, hi = torch.full_like(p, -_FAR), torch.full_like(p, _FAR)
        if self.docs is not None:
            lo, hi = self._doc_span(p)
        if self.causal:
            hi = torch.minimum(hi, p + 1)
        left, right = self.window
        if left >= 0:
            lo = torch.maximum(lo, p - left)
        if right >= 0:
            hi = torch.minimum(hi, p + right + 1)
        return lo, hi

    def query_bounds(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global queries `[lo, hi)` that see the keys at global positions `t` (int64)."""
        lo, hi = torch.full_like(t, -_FAR), torch.full_like(t, _FAR)
        if self.docs is not None:
            lo, hi = self._doc_span(t)
        if self.causal:
            lo = torch.maximum(lo, t)
        left, right = self.window
        if left >= 0:  # t >= p - left
            hi = torch.minimum(hi, t + left + 1)
        if right >= 0:  # t <= p + right
            lo = torch.maximum(lo, t - right)
        return lo, hi


def visible_per_position(rule: Rule, seqlen: int) -> torch.Tensor:
    """The number of keys of `[0, seqlen)` each query position of `[0, seqlen)` sees under `rule`
    (int64 `[seqlen]`): the work measure of layouts (`ringlse.ring.layout.rank_work`)."""
    lo, hi = rule.key_bounds(torch.arange(seqlen))
    return (hi.clamp(max=seqlen) - lo.clamp(min=0)).clamp(min=0)


class Span(NamedTuple):
    """Positions `start, start + stride, ...` (`length` of them) of a block's rows."""

    start: int
    length: int
    stride: int = 1

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        return self.start + self.stride * torch.arange(self.length, dtype=torch.int64, device=device)

    def local(self, bound: torch.Tensor) -> torch.Tensor:
        """Global bounds -> local row indices (the first row at or after `bound`), clamped to the span."""
        return (-((self.start - bound) // self.stride)).clamp(0, self.length)

    def cut(self, a: int, b: int) -> Span:
        """Its rows `[a, b)`."""
        return Span(self.start + a * self.stride, b - a, self.stride)


class Runs(NamedTuple):
    """Rows whose positions are several `Span`s one after another, increasing throughout (a rank of
    the `balanced` layout): one block over all of them, whose per-row intervals stay exact because
    the keys a query sees are one range of positions, hence one range of rows."""

    spans: tuple[Span, ...]

    @property
    def length(self) -> int:
        return sum(s.length for s in self.spans)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.cat([s.positions(device) for s in self.spans])

    def local(self, bound: torch.Tensor) -> torch.Tensor:
        """Global bounds -> local row indices (the first row at or after `bound`), as `Span.local`: the
        rows of the spans that end at or before `bound`, plus `Span.local` in the first that does not
        (a search among the spans' ends, not among every row's position)."""
        ends, table = _runs_table(self)
        start, stride, length, before = table.to(bound.device)[torch.searchsorted(ends.to(bound.device), bound,
                                                                                  right=True)].unbind(1)
        return before + torch.minimum((-((start - bound) // stride)).clamp(min=0), length)

    def cut(self, a: int, b: int) -> Runs:
        """Its rows `[a, b)`, the spans cut to them (empty ones left out)."""
        spans, first = [], 0
        for s in self.spans:
            lo, hi = max(a - first, 0), min(b - first, s.length)
            if lo < hi:
                spans.append(s.cut(lo, hi))
            first += s.length
        return Runs(tuple(spans))


@functools.lru_cache(maxsize=64)
def _runs_table(runs: Runs) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ends, table)` of `Runs.local`: one past each span's last position, and per span `(start, stride,
    length, rows before it)`, with a last row for bounds past every span (all rows before it)."""
    rows = [(s.start, s.stride, s.length) for s in runs.spans]
    before = [0]
    for _, _, n in rows:
        before.append(before[-1] + n)
    ends = torch.tensor([a + (n - 1) * d + 1 for a, d, n in rows], dtype=torch.int64)
    table = torch.tensor([r + (b,) for r, b in zip(rows, before)] + [(1 << 62, 1, 0, before[-1])], dtype=torch.int64)
    return ends, table


class Intervals(NamedTuple):
    """A block's visible pairs: query row `i` sees keys `[key_lo[i], key_hi[i])`, key `j` is seen by
    query rows `[query_lo[j], query_hi[j])` (int32, local indices, empty where lo >= hi)."""

    key_lo: torch.Tensor
    key_hi: torch.Tensor
    query_lo: torch.Tensor
    query_hi: torch.Tensor

    def kind(self) -> BlockKind:
        """EMPTY when no pair is visible, FULL when every pair is (both read back to the host)."""
        sq, sk = self.key_lo.numel(), self.query_lo.numel()
        visible = (self.key_hi - self.key_lo).clamp(min=0)
        total = int(visible.sum())
        if total == 0:
            return BlockKind.EMPTY
        return BlockKind.FULL if total == sq * sk else BlockKind.PARTIAL

    def box(self) -> tuple[int, int, int, int] | None:
        """`(r0, r1, k0, k1)`: the rows that see any key and the keys they see (None: nothing visible)."""
        seen = (self.key_hi > self.key_lo).nonzero().flatten()
        if seen.numel() == 0:
            return None
        rows = slice(int(seen[0]), int(seen[-1]) + 1)
        return rows.start, rows.stop, int(self.key_lo[rows].min()), int(self.key_hi[rows].max())

    def dense(self, device: torch.device | str) -> torch.Tensor:
        """`[sq, sk]` bool on `device` (for the PyTorch op, which forms the scores anyway; plans keep
        their intervals on the CPU)."""
        lo, hi = self.key_lo.to(device, non_blocking=True), self.key_hi.to(device, non_blocking=True)
        j = torch.arange(self.query_lo.numel(), device=device)
        return (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])


def block_intervals(rule: Rule, q: Span | Runs, k: Span | Runs, device: torch.device | str | None = None
                    ) -> Intervals:
    """The visible pairs of the block `q` x `k` under `rule`, as per-row intervals."""
    key_lo, key_hi = (k.local(b) for b in rule.key_bounds(q.positions(device)))
    query_lo, query_hi = (q.local(b) for b in rule.query_bounds(k.positions(device)))
    key_hi, query_hi = torch.maximum(key_hi, key_lo), torch.maximum(query_hi, query_lo)
    return Intervals(*(x.to(torch.int32) for x in (key_lo, key_hi, query_lo, query_hi)))


def planned_intervals(rule: Rule, q: Span | Runs, k: Span | Runs) -> Intervals:
    """`block_intervals` on the CPU for the plans, cached for blocks of up to `CACHED_ROWS` rows: every
    layer of a model, and each of its calls, plans the same blocks under the same rule (32K tokens in 8
    documents: 2 ms per block on a CPU core, every call, before the cache). Larger blocks are computed
    each time (their kernels' time grows with the rows squared, the intervals' linearly; the cache holds
    at most 64 x 8 bytes x `CACHED_ROWS`). The tensors are shared: readers only. Where CUDA is, they are
    in pinned memory: a kernel's copy of more than 64 KB from pageable memory waits for the GPU to reach
    it, which took the host of a 4-GPU ring over 128K tokens (stripe layout, documents: 32K-row blocks)
    42 of its 48 ms per call instead of letting it run ahead."""
    if q.length + k.length > CACHED_ROWS:
        return _pinned(block_intervals(rule, q, k, device="cpu"))
    return _cached_intervals(rule, q, k)


CACHED_ROWS = 1 << 17


@functools.lru_cache(maxsize=64)
def _cached_intervals(rule: Rule, q: Span | Runs, k: Span | Runs) -> Intervals:
    return _pinned(block_intervals(rule, q, k, device="cpu"))


def _pinned(iv: Intervals) -> Intervals:
    if not torch.cuda.is_available():
        return iv
    return Intervals(*(x.pin_memory() for x in iv))
