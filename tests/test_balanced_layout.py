"""The `balanced` layout (CONVENTIONS.md §5): chunks of a packed sequence placed on ranks by the documents'
causal work. Cheapest first: its balance on the two document sets of issue 55, its positions and
determinism, its plans (one exact call per step, checked pair by pair against tests/mask_oracle.py), its
errors, the benchmark's pure parts; then on gloo ranks, W = 2, 3, 4: shard/unshard, and `ring_attention`
against the float64 oracle forward and backward on the `torch` (float64) and `triton` (interpreter:
float32, float16) backends, with and without a window."""

from __future__ import annotations

import importlib
import itertools
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ringlse
from dist_harness import run_ranks
from mask_oracle import _visible, oracle
from ringlse.masks import BlockKind, Rule, Runs, Span, block_intervals
from ringlse.ring.balance import MIN_CHUNK, assign, chunk_size
from ringlse.ring.layout import Balanced, imbalance, layout_of, local_positions, rank_work, segments
from ringlse.ring.plan import key_pieces, kv_route, plan_step_masked, rows_read, split_keys
from ringlse.testing import RESULT_NAMES, attention_with_grads, judge, naive_attention, random_inputs, ring_with_grads

REPO = Path(__file__).resolve().parents[1]
BAR = 1.05  # issue 55: max/mean of visible pairs per rank


def _bench(name: str):
    """A module of benchmarks/ (appended to sys.path, so that it shadows nothing)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.append(str(REPO / "benchmarks"))
    return importlib.import_module(name)


# --- balance on the document sets (pure CPU) -------------------------------------------------------------------

BALANCE_CASES = [(docs, world, per_rank) for docs in ("loguniform", "equal2k") for per_rank in (8192, 32768)
                 for world in range(2, 9)]


@pytest.mark.parametrize("docs_name,world,per_rank", BALANCE_CASES,
                         ids=[f"{d}-W{w}-{p // 1024}K" for d, w, p in BALANCE_CASES])
def test_balance_within_5_percent(docs_name, world, per_rank):
    """Visible pairs of each rank's queries (the measure of benchmarks/mask_balance.py) within 5% of
    the mean; documents of 2K stay whole (one run per rank)."""
    seqlen = per_rank * world
    docs = _bench("mask_balance").document_set(docs_name, seqlen)
    layout = Balanced(docs)
    ratio = imbalance(Rule(True, docs=docs), layout, world, seqlen)
    assert ratio <= BAR, f"{docs_name} W={world} S={seqlen}: max/mean {ratio:.4f}"
    if docs_name == "equal2k":
        assert all(len(segments(layout, r, world, per_rank)) == 1 for r in range(world))


@pytest.mark.parametrize("world,seqlen,docs", [
    (2, 384, (0, 1, 1, 70, 222, 379, 384)),
    (3, 576, (0, 40, 41, 192, 576)),
    (4, 4096, (0, 4096)),
    (5, 5 * 8192, (0, 300, 9000, 9100, 30000, 5 * 8192)),
], ids=["W2-S384-chunk64", "W3-S576", "W4-one-document", "W5-S40K"])
def test_positions_are_chunks_increasing_and_cover_the_sequence(world, seqlen, docs):
    layout, n, chunk = Balanced(docs), seqlen // world, chunk_size(seqlen, world)
    per_rank = [local_positions(layout, r, world, n) for r in range(world)]
    assert all(p.numel() == n and bool((p[1:] > p[:-1]).all()) for p in per_rank)
    assert torch.equal(torch.cat(per_rank).sort().values, torch.arange(seqlen))
    for r in range(world):
        assert all(s.global_start % chunk == 0 and s.length % chunk == 0 and s.stride == 1
                   for s in segments(layout, r, world, n))


def test_deterministic_from_documents_and_world():
    """The same boundaries (tuple, list or tensor) give the same placement, computed afresh."""
    seqlen, world = 8 * 8192, 8
    docs = _bench("mask_balance").document_set("loguniform", seqlen)
    first = assign(docs, world)
    assign.cache_clear()
    assert assign(docs, world) == first
    for given in (list(docs), torch.tensor(docs), torch.tensor(docs, dtype=torch.int32)):
        assert layout_of("balanced", given, seqlen, "test") == Balanced(docs)
    assert hash(Balanced(docs)) == hash(Balanced(tuple(docs)))


def test_balanced_beats_zigzag_where_zigzag_is_off():
    """The issue's example: 11 log-uniform documents at W = 4 (zigzag 1.78, contiguous 1.53)."""
    docs = _bench("mask_balance").document_set("loguniform", 4 * 8192)
    rule = Rule(True, docs=docs)
    assert len(docs) - 1 == 11
    work = rank_work(rule, Balanced(docs), 4, 4 * 8192)
    assert max(work) / (sum(work) / 4) <= BAR < imbalance(rule, "zigzag", 4, 4 * 8192)


# --- plans: one call per step, exact ------------------------------------------------------------------------------

def _covered(calls, n: int) -> torch.Tensor:
    count = torch.zeros(n, n, dtype=torch.int64)
    for c in calls:
        assert not c.causal
        count[c.q0:c.q1, c.k0:c.k1] += 1 if c.intervals is None else c.intervals.dense("cpu").long()
    return count


PLAN_CASES = [(world, docs, rule) for world, docs, rules in (
    (2, (0, 1, 1, 70, 222, 379, 384), ((True, (-1, -1)), (False, (4, 7)))),
    (3, (0, 40, 41, 192, 576), ((True, (-1, -1)), (True, (9, 0)))),
    (4, (0, 100, 101, 500, 768), ((True, (-1, -1)), (False, (4, 7))))) for rule in rules]


@pytest.mark.parametrize("world,docs,rule", PLAN_CASES, ids=lambda x: str(x))
def test_plan_is_one_exact_call_per_step(world, docs, rule):
    """Each step of a balanced rank is at most one call whose intervals hold exactly the visible
    pairs (from the pairs' global positions); the rows it reads are the first to last key seen."""
    causal, window = rule
    seqlen = docs[-1]
    layout, n, full = Balanced(docs), seqlen // world, Rule(causal, window, docs)
    assert max(len(segments(layout, r, world, n)) for r in range(world)) >= 2  # several runs in one call
    for rank, src in itertools.product(range(world), repeat=2):
        calls = plan_step_masked(layout, rank, src, world, n, full)
        assert len(calls) <= 1
        pq, pk = local_positions(layout, rank, world, n).tolist(), local_positions(layout, src, world, n).tolist()
        truth = torch.tensor([[_visible(p, t, causal, window, docs) for t in pk] for p in pq]).long()
        assert torch.equal(_covered(calls, n), truth), (rank, src)
        seen = truth.any(0).nonzero().flatten()
        assert rows_read(calls) == ((int(seen[0]), int(seen[-1]) + 1) if seen.numel() else (0, 0))
        halves = split_keys(calls, n // 2)
        assert torch.equal(_covered(halves[0] + halves[1], n), truth)
        assert torch.equal(_covered([c for p in key_pieces(calls, n, 4) for c in p], n), truth)
    route = kv_route(layout, world, n, full)
    assert set(route.steps) <= set(range(1, world))


def test_intervals_of_runs_classify_full_empty_and_partial_blocks():
    """`Intervals.kind()` / `box()` on blocks whose rows are several runs of positions."""
    q = Runs((Span(0, 64), Span(320, 64)))
    k = Runs((Span(64, 64), Span(256, 64)))
    assert block_intervals(Rule(False, docs=(0, 512)), q, k).kind() is BlockKind.FULL
    iv = block_intervals(Rule(True, docs=(0, 128, 512)), Runs((Span(0, 64),)), k)  # keys after every query
    assert iv.kind() is BlockKind.EMPTY and iv.box() is None
    iv = block_intervals(Rule(True, docs=(0, 128, 300, 512)), q, k)
    assert iv.kind() is BlockKind.PARTIAL
    # q rows 0..63 (positions 0..63) see no key (all later); rows 64..127 (positions 320..383, document
    # [300, 512)) see k's positions 300..319: rows 108..127
    assert iv.box() == (64, 128, 108, 128)
    assert q.cut(32, 96) == Runs((Span(32, 32), Span(320, 32)))
    bounds = torch.tensor([-5, 0, 63, 64, 319, 320, 383, 400])
    assert torch.equal(q.local(bounds), torch.tensor([0, 0, 63, 64, 64, 64, 127, 128]))


@settings(max_examples=200, deadline=None)
@given(st.integers(-20, 20), st.lists(st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(0, 6)), min_size=1,
                                      max_size=6))
def test_runs_local_is_the_first_row_at_or_after_each_bound(first, shape):
    """`Runs.local` (a search among the spans) equals a search among every row's position, strided spans
    and bounds before, between and after them included."""
    spans, pos = [], first
    for stride, length, gap in shape:
        spans.append(Span(pos, length, stride))
        pos += (length - 1) * stride + 1 + gap
    runs = Runs(tuple(spans))
    bounds = torch.arange(first - 5, pos + 5)
    assert torch.equal(runs.local(bounds), torch.searchsorted(runs.positions(), bounds))


# --- errors -----------------------------------------------------------------------------------------------------

def test_balanced_without_documents_raises():
    x = torch.randn(1, 256, 2, 8)
    with pytest.raises(ValueError, match="'balanced' layout needs cu_seqlens"):
        ringlse.shard(x, "balanced")
    with pytest.raises(ValueError, match="'balanced' layout needs cu_seqlens"):
        ringlse.ring_attention(x, x, x, causal=True, layout="balanced", backend="torch")


def test_length_that_does_not_divide_raises():
    x = torch.randn(1, 100, 2, 8)
    rule = rf"sequence length 100 does not divide over W=1 ranks in the 'balanced' layout \(needs a multiple of " \
           rf"{MIN_CHUNK}·W = {MIN_CHUNK}"
    with pytest.raises(ValueError, match=rule):
        ringlse.shard(x, "balanced", cu_seqlens=[0, 40, 100])
    with pytest.raises(ValueError, match=rule):
        ringlse.ring_attention(x, x, x, causal=True, layout="balanced", cu_seqlens=[0, 40, 100], backend="torch")
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the sequence length 128"):
        ringlse.shard(torch.randn(1, 128, 2, 8), "balanced", cu_seqlens=[0, 40, 100])


# --- the benchmark's pure parts -------------------------------------------------------------------------------

def test_benchmark_document_sets_and_flops():
    mb, rd = _bench("mask_balance"), _bench("ring_documents")
    docs = mb.document_set("loguniform", 65536)
    lengths = [b - a for a, b in zip(docs, docs[1:])]
    assert docs[0] == 0 and docs[-1] == 65536 and all(256 <= n <= 16384 for n in lengths[:-1])
    assert mb.document_set("equal2k", 8192) == (0, 2048, 4096, 6144, 8192)
    small = (0, 3, 3, 10)  # visible pairs counted pair by pair
    assert rd.visible_pairs(small) == sum(_visible(p, t, True, (-1, -1), small) for p in range(10) for t in range(10))
    assert rd.forward_flops(1000, head_dim=128, heads=64) == 4 * 1000 * 128 * 64
    assert rd.result_name(4, "NVIDIA H100 80GB HBM3") == "ring_documents-4xH100-80GB-HBM3.json"
    rows = [rd.row_of("triton", lay, "equal2k", mb.document_set("equal2k", 4 * 8192), 4, {"fwd": 2.0, "fwd+bwd": 7.0},
                      {"fwd": 6.0, "fwd+bwd": 20.0}) for lay in ("zigzag", "balanced")]
    rows.append(rd.row_of("sdpa", "balanced", "equal2k", mb.document_set("equal2k", 4 * 8192), 4, {}, {},
                          error="ValueError: refused"))
    flops = rd.forward_flops(rd.visible_pairs(mb.document_set("equal2k", 4 * 8192)))
    assert rows[0]["fwd_tflops_per_gpu"] == pytest.approx(flops / (4 * 2e-3) / 1e12)
    assert rows[0]["bwd_tflops_per_gpu"] == pytest.approx(2.5 * flops / (4 * 5e-3) / 1e12)
    assert rows[0]["single_bwd_tflops"] == pytest.approx(2.5 * flops / 14e-3 / 1e12)
    assert rows[2]["fwd_tflops_per_gpu"] is None and rows[1]["max_runs"] == 1
    env = dict(gpus=4, gpu="NVIDIA H100 80GB HBM3", torch="x", triton="y", command="torchrun ...")
    shape = dict(tokens_per_gpu=8192, heads=64, kv_heads=8, head_dim=128)
    table = _bench("report").ring_documents(dict(environment=env, shape=shape, rows=rows))
    assert len(table) == 4 + len(rows) and "refused" in table[-1]


# --- gloo ranks: shard/unshard and the ring against the oracle ----------------------------------------------------

B, D = 1, 16


def _docs(seqlen: int) -> list[int]:
    """An empty document, one of length 1, documents crossing chunks and ranks."""
    return [0, 1, 1, 70, seqlen // 2 + 30, seqlen - 5, seqlen]


# Triton cases per world size: (dtype, window); each dtype with and without a window across W (the
# interpreter takes seconds per case)
TRITON = {2: ((torch.float32, (-1, -1)), (torch.float16, (23, 0))), 3: ((torch.float16, (-1, -1)),),
          4: ((torch.float32, (23, 0)),)}


def _ring_cases(world: int) -> list[dict]:
    """float64 on the torch op (with the lse's gradient), GQA 4/2, causal with and without a window and a
    bidirectional window; float32 and float16 on the Triton kernels, MQA 2/1 (the interpreter's time
    grows with the heads)."""
    rules = [(True, (-1, -1)), (True, (23, 0)), (False, (9, 17))]
    cases = [dict(backend="torch", dtype=torch.float64, causal=c, window=w, heads=(4, 2), seed=i)
             for i, (c, w) in enumerate(rules)]
    cases += [dict(backend="triton", dtype=dt, causal=True, window=w, heads=(2, 1), seed=10 + i)
              for i, (dt, w) in enumerate(TRITON[world])]
    return cases


def balanced_rings(rank: int, world: int, cases: list[dict]) -> list[str]:
    """shard/unshard round trips, then each case through `ring_attention` (layout balanced), forward and
    backward, judged on rank 0 against the oracle by CONVENTIONS.md §7; returns the failures."""
    failures = []
    seqlen = 64 * world * 3  # chunks of 64 (not a multiple of 128 per rank), three per rank
    docs = _docs(seqlen)
    x = torch.randn(2, seqlen, 3, 5, generator=torch.Generator().manual_seed(3))
    for dim in (1, 2):
        y = x if dim == 1 else x.transpose(1, 2).contiguous()
        local = ringlse.shard(y, "balanced", dim=dim, cu_seqlens=docs)
        want = y.index_select(dim, local_positions(Balanced(tuple(docs)), rank, world, seqlen // world))
        if not (torch.equal(local, want) and torch.equal(ringlse.unshard(local, "balanced", dim=dim,
                                                                         cu_seqlens=torch.tensor(docs)), y)):
            failures.append(f"rank {rank}: shard/unshard round trip along dim {dim}")
    for c in cases:
        q, k, v, dout, dlse = random_inputs(B, seqlen, *c["heads"], D, c["dtype"], seed=c["seed"])
        dlse = dlse if c["dtype"] == torch.float64 else None
        ours = ring_with_grads(q, k, v, dout, dlse, causal=c["causal"], layout="balanced", backend=c["backend"],
                               window_size=c["window"], cu_seqlens=docs, return_lse=dlse is not None)
        if rank != 0:
            continue
        positions = range(seqlen)
        ref = attention_with_grads(lambda *t: oracle(*t, positions, positions, c["causal"], c["window"], docs),
                                   q, k, v, dout, dlse, upcast=True)
        base = [None] * 5
        if c["dtype"] == torch.float16:
            base = attention_with_grads(naive_attention, q, k, v, dout, upcast=False, causal=c["causal"],
                                        q_start=0, window_size=c["window"], cu_seqlens=docs)
        for name, a, r, b in zip(RESULT_NAMES, ours, ref, base):
            if c["dtype"] == torch.float64:
                try:
                    torch.testing.assert_close(a, r)
                except AssertionError as e:
                    failures.append(f"W={world} {c}: {name}: {str(e).splitlines()[0]}")
                continue
            verdict = judge(name, a, r, b, c["dtype"], is_lse=name == "lse")
            if not verdict.ok:
                failures.append(f"W={world} {c}: {verdict}")
    failures += _through_transformers(rank, world, seqlen)
    # without boundaries, or with a length that does not divide: ValueError on every rank, same text
    for what, n, bounds in (("no documents", 64, None), ("length", 96, [0, 10, 96 * world])):
        t = torch.randn(1, n, 2, 8)
        try:
            ringlse.ring_attention(t, t, t, causal=True, layout="balanced", cu_seqlens=bounds, backend="torch")
            failures.append(f"rank {rank}: {what}: no error")
        except ValueError as e:
            expected = "needs cu_seqlens" if bounds is None else f"needs a multiple of 64·W = {64 * world}"
            if expected not in str(e):
                failures.append(f"rank {rank}: {what}: {e}")
    return failures


def _through_transformers(rank: int, world: int, seqlen: int) -> list[str]:
    """The transformers integration in the balanced layout, without a model: `prepare_batch` shards by
    the documents its position ids restart at, and an attention call inside `ring()` equals
    `ringlse.attention` on the whole sequence (float64)."""
    from ringlse.integrations import transformers as rt

    docs = [0, 1, 70, seqlen // 2 + 30, seqlen - 5, seqlen]  # position restarts cannot say "empty"
    pos = torch.cat([torch.arange(b - a) for a, b in zip(docs, docs[1:])])[None]
    ids = torch.arange(seqlen)[None]
    batch = rt.prepare_batch(ids, position_ids=pos, layout="balanced")
    failures = []
    mine = ringlse.shard(ids, "balanced", cu_seqlens=docs)
    if batch.cu_seqlens != tuple(docs) or not torch.equal(batch.input_ids, mine):
        failures.append(f"rank {rank}: prepare_batch: documents {batch.cu_seqlens}, ids {batch.input_ids.tolist()}")
    q, k, v, _, _ = random_inputs(1, seqlen, 4, 2, D, torch.float64, seed=20)
    with rt.ring(layout="balanced", cu_seqlens=batch.cu_seqlens, backend="torch"):
        local = [ringlse.shard(t, "balanced", cu_seqlens=docs).transpose(1, 2) for t in (q, k, v)]
        out, _ = rt.attention_forward(torch.nn.Identity(), *local, None, position_ids=batch.position_ids)
    whole = ringlse.attention(q, k, v, causal=True, cu_seqlens=docs, backend="torch")
    try:
        torch.testing.assert_close(ringlse.unshard(out, "balanced", cu_seqlens=docs), whole)
    except AssertionError as e:
        failures.append(f"rank {rank}: attention inside ring(): {str(e).splitlines()[0]}")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_ring_balanced_matches_the_oracle(world, tmp_path):
    per_rank = run_ranks(balanced_rings, world, tmp_path, _ring_cases(world), timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures[:10])
