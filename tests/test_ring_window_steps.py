"""Rings whose window (or documents) leave most of another rank's shard unseen: exact against
the dense-mask oracle (float64, forward and gradients), and their K/V move only at the steps some rank
reads, only the rows read, from owner to reader; a plain causal ring still passes whole blocks from
neighbour to neighbour at every step.

The messages are counted on each spawned rank by wrapping its `RingComm` object's `exchange` and
`send_recv` (the instance's, for the duration of one call); what every rank should send is worked out
here, pair by pair, from the rule and the layouts."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import pytest
import torch

import ringlse
from dist_harness import run_ranks
from mask_oracle import _visible, oracle
from ringlse.testing import RESULT_NAMES, attention_with_grads, random_inputs, ring_with_grads

F64 = torch.float64
B, H, HKV, D = 2, 4, 2, 8  # two sequences: K/V rows of a batch are not contiguous


def _docs(s: int) -> list[int]:
    """Documents crossing ranks, one empty and one of length 1."""
    return [0, 40, 40, 41, s // 2 + 3, s]


# (layout, n per rank): odd lengths where the layout allows (zigzag needs an even one)
SHARDS = [("contiguous", 97), ("zigzag", 98), ("stripe", 97)]
RULES = [(True, (5, 0)), (False, (0, 3)), (False, (7, 7))]


def _exact_cases() -> list[dict]:
    return [dict(layout=layout, n=n, causal=causal, window=window, docs=docs, seed=i)
            for i, ((layout, n), (causal, window), docs) in enumerate(
                (sh, r, d) for sh in SHARDS for r in RULES for d in (False, True))]


def exact_rings(rank: int, world: int, cases: list[dict]) -> list[str]:
    """Each case through `ring_attention` (torch op) against the oracle on the full sequence, on rank 0."""
    failures = []
    for c in cases:
        s = c["n"] * world
        docs = _docs(s) if c["docs"] else None
        q, k, v, dout, dlse = random_inputs(B, s, H, HKV, D, F64, seed=c["seed"])
        ours = ring_with_grads(q, k, v, dout, dlse, causal=c["causal"], layout=c["layout"], backend="torch",
                               window_size=c["window"], cu_seqlens=docs)
        if rank != 0:
            continue
        ref = attention_with_grads(lambda *t: oracle(*t, range(s), range(s), c["causal"], c["window"], docs),
                                   q, k, v, dout, dlse, upcast=True)
        for name, a, b in zip(RESULT_NAMES, ours, ref):
            try:
                torch.testing.assert_close(a, b)
            except AssertionError as e:
                failures.append(f"W={world} {c}: {name}: {str(e).splitlines()[0]}")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_short_windows_are_exact(world, tmp_path):
    per_rank = run_ranks(exact_rings, world, tmp_path, _exact_cases(), timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures[:10])


# --- what moves -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _sends_logged(comm) -> Iterator[list]:
    """Wrap `comm`'s `exchange` and `send_recv` (this object's only, until the block ends) to log every
    message it sends as `(tag, step, destination rank, rows, bytes)`."""
    log: list = []
    exchange, send_recv = comm.exchange, comm.send_recv

    def logged_exchange(*args, **kw):
        a = inspect.signature(exchange).bind(*args, **kw)
        a.apply_defaults()
        send = a.arguments["send"]
        rows = send.numel() // (2 * B * HKV * D)  # a whole packed K/V block: one flat buffer (`KVPack`)
        log.append((a.arguments["tag"], a.arguments["step"], (comm.rank + 1) % comm.world, rows, send.nbytes))
        return exchange(*args, **kw)

    def logged_send_recv(*args, **kw):
        a = inspect.signature(send_recv).bind(*args, **kw)
        a.apply_defaults()
        log.extend((a.arguments["tag"], a.arguments["step"], a.arguments["dst"], t.shape[-3], t.nbytes)
                   for t in a.arguments["sends"])
        return send_recv(*args, **kw)

    comm.exchange, comm.send_recv = logged_exchange, logged_send_recv
    try:
        yield log
    finally:
        del comm.exchange, comm.send_recv  # the class's methods again


def counted_rings(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case twice, with this rank's sends logged: a forward alone (no gradient), then forward and
    backward."""
    from ringlse.ring.comm import RingComm

    comm = RingComm.for_group(None)  # the object ring_attention uses on the default group
    results = []
    for c in cases:
        s = c["n"] * world
        q, k, v, dout, _ = random_inputs(B, s, H, HKV, D, F64, seed=c["seed"])
        kw = dict(causal=c["causal"], layout=c["layout"], backend="torch", window_size=c["window"],
                  cu_seqlens=_docs(s) if c["docs"] else None)
        with _sends_logged(comm) as forward, torch.no_grad():
            ringlse.ring_attention(*(ringlse.shard(t, c["layout"]) for t in (q, k, v)), **kw)
        with _sends_logged(comm) as both:
            ring_with_grads(q, k, v, dout, **kw)
        results.append({"forward": forward, "both": both})
    return results


def _positions(layout: str, rank: int, world: int, n: int) -> list[int]:
    """Global positions of a rank's rows (CONVENTIONS.md §5), written out independently of ringlse."""
    if layout == "contiguous":
        return list(range(rank * n, (rank + 1) * n))
    if layout == "zigzag":
        c = n // 2
        return [*range(rank * c, (rank + 1) * c), *range((2 * world - 1 - rank) * c, (2 * world - rank) * c)]
    return list(range(rank, world * n, world))


def _rows_seen(c: dict, world: int, owner: int, reader: int) -> int:
    """How many rows, first to last, of `owner`'s K/V some query of `reader` sees (0: none)."""
    docs = _docs(c["n"] * world) if c["docs"] else None
    queries = _positions(c["layout"], reader, world, c["n"])
    seen = [j for j, t in enumerate(_positions(c["layout"], owner, world, c["n"]))
            if any(_visible(p, t, c["causal"], c["window"], docs) for p in queries)]
    return seen[-1] - seen[0] + 1 if seen else 0


def _kv_bytes(rows: int) -> int:
    return 2 * B * rows * HKV * D * 8  # K and V, float64


COUNTED = {
    "contiguous-w5": dict(layout="contiguous", n=97, causal=True, window=(5, 0), docs=False, seed=1),
    "zigzag-w5": dict(layout="zigzag", n=98, causal=True, window=(5, 0), docs=False, seed=2),
    "contiguous-w7_7": dict(layout="contiguous", n=97, causal=False, window=(7, 7), docs=False, seed=3),
    "zigzag-w0_3-docs": dict(layout="zigzag", n=98, causal=False, window=(0, 3), docs=True, seed=4),
    "contiguous-docs": dict(layout="contiguous", n=97, causal=True, window=(-1, -1), docs=True, seed=5),
}


@pytest.mark.parametrize("world", [3, 4], ids=lambda w: f"W{w}")
def test_kv_moves_only_the_rows_read(world, tmp_path):
    """Rank r sends rank r + s, at step s, the rows of its K/V that rank r + s's queries see, first to
    last, and nothing at a step where that rank sees none; the backward brings the same K/V again, and
    its dk/dv messages go only where K/V went, never longer than the rows that went."""
    cases = list(COUNTED.values())
    per_rank = run_ranks(counted_rings, world, tmp_path, cases, timeout=300)
    for name, (i, c) in zip(COUNTED, enumerate(cases)):
        for rank, results in enumerate(per_rank):
            forward, both = results[i]["forward"], results[i]["both"]
            kv_tags = {tag for tag, *_ in forward}
            for s in range(1, world):
                dst = (rank + s) % world
                rows = _rows_seen(c, world, rank, dst)
                sent = [m for m in forward if m[1] == s]
                where = f"{name} W={world} rank {rank} step {s} to rank {dst}"
                assert all(m[2] == dst and m[3] == rows for m in sent), f"{where}: expected {rows} rows, sent {sent}"
                assert sum(m[4] for m in sent) == _kv_bytes(rows), f"{where}: {sent}"
                kv_again = [m for m in both if m[1] == s and m[0] in kv_tags]
                assert sorted(kv_again) == sorted(2 * sent), f"{where}: K/V of both passes {kv_again}, forward {sent}"
            for tag, s, dst, rows, _ in both:
                if tag not in kv_tags:  # dk/dv of our step s go home to the owner, rank - s
                    assert dst == (rank - s) % world and 0 < rows <= _rows_seen(c, world, dst, rank), (name, rank, s)
            if c["layout"] == "contiguous" and c["window"] == (5, 0):  # the window's rows, at step 1 only
                assert all(m[1] == 1 and m[3] <= 5 for m in both), (name, rank, both)


def test_plain_causal_ring_still_passes_whole_blocks(tmp_path):
    """No window, no documents: every step moves the whole block to the next rank, as before."""
    world, n = 3, 6
    c = dict(layout="zigzag", n=n, causal=True, window=(-1, -1), docs=False, seed=6)
    per_rank = run_ranks(counted_rings, world, tmp_path, [c], timeout=120)
    for rank, results in enumerate(per_rank):
        forward = results[0]["forward"]
        assert sorted((s, dst, rows, nbytes) for _, s, dst, rows, nbytes in forward) == [
            (s, (rank + 1) % world, n, _kv_bytes(n)) for s in range(1, world)], forward
