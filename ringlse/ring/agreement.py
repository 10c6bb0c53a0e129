"""The agreement before any K/V moves: every rank of the ring posts a row of integers describing its
inputs (`AgreementRow`: shapes, dtype, options) and whether it found its own inputs invalid; then every rank raises
the same ValueError when any rank's inputs are bad or two ranks disagree, or goes on together.

One path: a gloo all-to-all of the rows over the ring's ranks (the ring's own group when it is gloo,
else a gloo group of the same ranks made once). It runs on the host, so it waits for no kernel, and a
caller can queue local work before it checks (`Agreement.ready` polls it). Every rank sends its row
to every rank directly, so when the exchange fails or times out, the rows that did not arrive name
the ranks it waited for (a gather passed round a ring would name the wrong one). When some rank
reported an error, a second all-to-all of fixed-size byte rows (every rank knows after the first,
so it stays collective, and the good path never pays for it) brings every rank's error text, so the
ValueError reads the same on every rank: `ring_attention: invalid input: rank 0: ...; rank 2: ...`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ringlse.checks import SUPPORTED_DTYPES
from ringlse.masks import Rule
from ringlse.ring.layout import LAYOUT_NAMES

# Rows start with a marker, so that the rows that arrived can be told from those that did not.
_ARRIVED = 1
# Bytes of one rank's error text in the second exchange (longer texts are cut, with "...").
TEXT_BYTES = 300

# `describe(meta)` -> {field name: value as text}: how a disagreement is reported (None: by index).
Describe = Callable[[Sequence[int]], dict[str, str]]
# `fault(step, peers, original)` -> the RuntimeError of a failed exchange (`RingComm.fault`).
Fault = Callable[[int, Sequence[int], BaseException], RuntimeError]


@dataclasses.dataclass(frozen=True)
class AgreementRow:
    """What the ranks of one ring call must agree on, as the fixed-length row of integers they
    exchange (`to_row` / `from_row`). A rank whose inputs are invalid sends the
    row (`invalid()`: the error flag decides; every row has the same length, as the exchange needs)."""

    q_shape: tuple[int, ...]
    kv_shape: tuple[int, ...]
    dtype: int  # index into `SUPPORTED_DTYPES`
    causal: bool
    layout: int  # index into `LAYOUT_NAMES`
    scale: int  # softmax_scale * 2**30, rounded: ranks compare integers, never floats
    return_lse: bool
    copy_engines: bool  # the K/V transport (`ringlse.ring.kv_transport.Transport`)
    window: tuple[int, int]
    doc_count: int  # document boundaries
    doc_digest: int  # a 56-bit digest of them (the row holds int64)
    softcap: int = 0  # softcap * 2**30, rounded (0: off)
    v_head_dim: int = 0  # V's head dim (K's is the last of `kv_shape`; they may differ: MLA)
    # (rank in the head group, its size) of a head-parallel call (`ringlse.ring.head_parallel`): the ranks
    # of one ring must hold the same heads; (0, 1) without a head group
    head_split: tuple[int, int] = (0, 1)

    NAMES = ("q shape", "k/v shape", "dtype", "causal", "layout", "softmax_scale", "return_lse", "K/V transport",
             "window_size", "documents", "softcap", "V head dim", "head group (rank, size)")

    @classmethod
    def of_call(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str, scale: float,
                return_lse: bool, copy_engines: bool, rule: Rule, softcap: float = 0.0,
                head_split: tuple[int, int] = (0, 1)) -> AgreementRow:
        """The row of a call whose inputs this rank found valid (one parameter per field the ranks compare)."""
        docs = rule.docs or ()
        digest = hashlib.blake2b(repr(docs).encode(), digest_size=7).digest()
        return cls(tuple(q.shape), tuple(k.shape), SUPPORTED_DTYPES.index(q.dtype), causal is True,
                   LAYOUT_NAMES.index(layout), round(scale * 2**30), return_lse is True, copy_engines, tuple(rule.window),
                   len(docs), int.from_bytes(digest, "little"), round(softcap * 2**30), v.shape[-1], tuple(head_split))

    @classmethod
    def invalid(cls) -> AgreementRow:
        """The row of a rank that found its own inputs invalid."""
        return cls((-1,) * 4, (-1,) * 4, -1, False, -1, 0, False, False, (-2, -2), -1, 0, 0, -1, (-1, -1))

    def to_row(self) -> list[int]:
        return [*self.q_shape, *self.kv_shape, self.dtype, int(self.causal), self.layout, self.scale,
                int(self.return_lse), int(self.copy_engines), *self.window, self.doc_count, self.doc_digest,
                self.softcap, self.v_head_dim, *self.head_split]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> AgreementRow:
        r = [int(x) for x in row]
        return cls(tuple(r[0:4]), tuple(r[4:8]), r[8], bool(r[9]), r[10], r[11], bool(r[12]), bool(r[13]),
                   (r[14], r[15]), r[16], r[17], r[18], r[19], (r[20], r[21]))

    def describe(self) -> dict[str, str]:
        """The row as named fields, for a disagreement's message."""
        if self.q_shape[0] < 0:
            return {name: "(invalid)" for name in self.NAMES}
        dtype = SUPPORTED_DTYPES[self.dtype] if 0 <= self.dtype < len(SUPPORTED_DTYPES) else self.dtype
        layout = LAYOUT_NAMES[self.layout] if 0 <= self.layout < len(LAYOUT_NAMES) else self.layout
        docs = "none" if self.doc_count == 0 else f"{self.doc_count} boundaries (digest {self.doc_digest:014x})"
        values = (self.q_shape, self.kv_shape, dtype, self.causal, layout, f"{self.scale / 2**30:.6g}",
                  self.return_lse, "copy engines" if self.copy_engines else "point-to-point", self.window, docs,
                  f"{self.softcap / 2**30:.6g}", self.v_head_dim, self.head_split)
        return {name: str(value) for name, value in zip(self.NAMES, values)}




def describe_row(row: Sequence[int]) -> dict[str, str]:
    """`Describe` for rows of `AgreementRow`s."""
    return AgreementRow.from_row(row).describe()


class Agreement:
    """The pending comparison of the ranks' rows: `ready()` says whether every rank's row is in
    (without waiting); calling it waits for them and raises ValueError on every rank when any rank
    reported an error or two ranks' rows differ, RuntimeError when a rank does not answer in time."""

    def __init__(self, ready: Callable[[], bool], check: Callable[[], None]):
        self.ready = ready
        self._check = check

    def __call__(self) -> None:
        self._check()


def post_agreement(rank: int, world: int, host_group: dist.ProcessGroup | None, meta: Sequence[int],
                   error: str | None, *, limit: datetime.timedelta | None = None, fault: Fault | None = None,
                   describe: Describe | None = None) -> Agreement:
    """Start comparing `meta` (ints describing this rank's inputs) and its local `error` across the
    `world` ranks of the gloo `host_group` (None: the default group); returns the pending `Agreement`.
    Every rank must call this once per ring call, whatever its inputs. Each exchange waits at most
    `limit` (None: the group's timeout); a failure or timeout raises `fault(step, peers, original)`
    (step 0: the rows, 1: the error texts; peers: the group ranks whose part did not arrive)."""
    if world == 1:
        return Agreement(lambda: True, lambda: decide([[0 if error is None else 1, *meta]], [error or ""], describe))
    row = torch.tensor([_ARRIVED, 0 if error is None else 1, *meta], dtype=torch.int64)
    table = torch.zeros((world, row.numel()), dtype=torch.int64)
    work = _post(table, row, host_group, rank, 0, fault)

    def check() -> None:
        _wait(work, table, rank, limit, 0, fault)
        rows = table[:, 1:].tolist()
        texts = None
        if any(r[0] for r in rows):  # the same on every rank: all go to the second exchange
            texts = _exchange_texts(rank, world, host_group, error, limit, fault)
        decide(rows, texts, describe)

    return Agreement(work.is_completed, check)


def _post(table: torch.Tensor, row: torch.Tensor, host_group, rank: int, step: int, fault: Fault | None):
    """Start the all-to-all of exchange `step` (this rank's `row` to every rank, theirs into `table`); a
    failure to start it (a peer already gone) is a fault naming every other rank, as a failed wait."""
    try:
        return dist.all_to_all_single(table, row.expand(table.shape[0], -1).contiguous(), group=host_group,
                                      async_op=True)
    except Exception as e:  # noqa: BLE001 - any failure of the exchange is a fault of the ring
        if fault is None:
            raise
        raise fault(step, [r for r in range(table.shape[0]) if r != rank], e) from e


def _wait(work, table: torch.Tensor, rank: int, limit: datetime.timedelta | None, step: int,
          fault: Fault | None) -> None:
    try:
        done = work.wait() if limit is None else work.wait(max(limit, datetime.timedelta(milliseconds=1)))
        if done is False:
            raise TimeoutError(f"not done within {limit}")
    except Exception as e:  # noqa: BLE001 - any failure of the exchange is a fault of the ring
        if fault is None:
            raise
        # rows that did not arrive (read while the transport may still write: names only, never data)
        missing = [r for r in range(table.shape[0]) if r != rank and int(table[r, 0]) != _ARRIVED]
        raise fault(step, missing, e) from e


def _exchange_texts(rank: int, world: int, host_group, error: str | None, limit, fault: Fault | None) -> list[str]:
    """Every rank's error text ("" where it had none), cut to `TEXT_BYTES` bytes."""
    data = _own_text(error or "").encode("utf-8", "replace")
    if len(data) > TEXT_BYTES:
        data = data[:TEXT_BYTES - 3] + b"..."
    row = torch.zeros(TEXT_BYTES + 1, dtype=torch.uint8)
    row[0] = _ARRIVED
    row[1:1 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    table = torch.zeros((world, TEXT_BYTES + 1), dtype=torch.uint8)
    work = _post(table, row, host_group, rank, 1, fault)
    _wait(work, table, rank, limit, 1, fault)
    return [bytes(t[1:].tolist()).rstrip(b"\0").decode("utf-8", "ignore") for t in table]


def _own_text(text: str) -> str:
    """A rank's error without the leading "ring_attention: " its checks put there."""
    prefix = "ring_attention: "
    return text[len(prefix):] if text.startswith(prefix) else text


def decide(rows: list[list[int]], texts: list[str] | None, describe: Describe | None = None) -> None:
    """Raise the same ValueError on every rank if any row carries an error flag (listing every such
    rank's error text) or the rows differ (listing, per field, which ranks hold which value)."""
    bad = [r for r, row in enumerate(rows) if row[0] != 0]
    if bad:
        texts = texts or [""] * len(rows)
        raise ValueError("ring_attention: invalid input: "
                         + "; ".join(f"rank {r}: {_own_text(texts[r]) or 'invalid input'}" for r in bad))
    if all(row == rows[0] for row in rows):
        return
    fields = [describe(row[1:]) if describe is not None else {f"field {i}": str(x) for i, x in enumerate(row[1:])}
              for row in rows]
    parts = []
    for name in fields[0]:
        holders: dict[str, list[int]] = {}
        for r, f in enumerate(fields):
            holders.setdefault(f.get(name, "?"), []).append(r)
        if len(holders) > 1:
            parts.append(f"{name}: " + ", ".join(
                f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                for value, ranks in holders.items()))
    raise ValueError("ring_attention: ranks disagree on shapes/dtype/options (every rank must pass the same): "
                     + "; ".join(parts or ["rows differ"]))
