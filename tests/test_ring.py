"""Ring attention on spawned gloo ranks vs the float64 reference on the unsharded sequence.

One spawn per world size runs a whole battery of cases (spawning costs seconds on 2 cores)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import ringlse
import ring_workers as rw
from dist_harness import run_ranks
from ringlse.testing import attention_with_grads, ring_with_grads

LAYOUTS = ("contiguous", "zigzag", "stripe")


def _cases(world: int) -> list[dict]:
    cases = []
    unit = 2 * world  # every layout divides
    # float64: exact, every layout x causal, MHA and GQA, head dim 80, an odd-ish local length
    for layout, causal in itertools.product(LAYOUTS, (False, True)):
        cases.append(dict(b=2, s=unit * 3, h=6, hkv=2, d=80, dtype=torch.float64, causal=causal, layout=layout, seed=1))
    cases.append(dict(b=1, s=unit * 5, h=4, hkv=4, d=16, dtype=torch.float64, causal=True, layout="zigzag", seed=2,
                      non_contiguous=True))
    cases.append(dict(b=1, s=unit * 4, h=4, hkv=1, d=32, dtype=torch.float64, causal=True, layout="stripe", seed=3))
    # bfloat16 by the CONVENTIONS.md §7 rule
    for layout in LAYOUTS:
        cases.append(dict(b=1, s=unit * 8, h=4, hkv=2, d=64, dtype=torch.bfloat16, causal=True, layout=layout, seed=4))
    cases.append(dict(b=1, s=unit * 8, h=4, hkv=2, d=64, dtype=torch.bfloat16, causal=False, layout="contiguous", seed=5))
    # from W = 3 the backward sends dk/dv home in pieces of keys (ringlse.ring.backward.DKV_PIECES): 150 local
    # keys go as pieces of 64, 64 and 22, each call cut where a piece ends
    for layout, causal in itertools.product(LAYOUTS, (False, True)):
        cases.append(dict(b=2, s=150 * world, h=2, hkv=1, d=16, dtype=torch.float64, causal=causal, layout=layout,
                          seed=6))
    # the same pieces where the op adds dq in its dk/dv pass (the Hopper kernel): dq with every piece
    for layout in ("zigzag", "stripe"):
        cases.append(dict(b=1, s=150 * world, h=2, hkv=1, d=16, dtype=torch.float64, causal=True, layout=layout,
                          seed=8, backend="torch_dq_with_dkdv"))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_ring_matches_reference(world, tmp_path):
    cases = _cases(world)
    per_rank = run_ranks(rw.battery, world, tmp_path, cases, timeout=300)
    for case, result in zip(cases, per_rank[0]):
        for name, ok, text in result["verdicts"]:
            assert ok, f"W={world} {case}: {text}"
    assert all(r is None for rank_results in per_rank[1:] for r in rank_results)


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_bad_inputs_raise_on_every_rank(world, tmp_path):
    shm = Path("/dev/shm")
    before = set(shm.glob("ringlse*")) if shm.is_dir() else set()
    per_rank = run_ranks(rw.expect_value_errors, world, tmp_path, 3, timeout=120)
    # failing calls leave nothing behind in host shared memory
    assert (set(shm.glob("ringlse*")) if shm.is_dir() else set()) == before
    for rank, results in enumerate(per_rank):
        for name, raised, message in results:
            assert raised, f"W={world} rank {rank}: {name}: {message}"
    # messages say what is wrong
    messages = dict((n, m) for n, _, m in per_rank[0])
    assert "zigzag" in messages["zigzag odd local length"] and str(3 * world) in messages["zigzag odd local length"]
    assert "dtype" in messages["dtype mismatch"]
    assert "multiple of nheads_kv" in messages["heads not divisible"]
    assert "V head dim 4 differs from Q/K head dim 8" in messages["V head dim differs"]
    assert "backends that take it: torch, triton" in messages["V head dim differs"]
    if world > 1:
        assert "V head dim: 4 on rank 0, 6 on rank" in messages["ranks disagree on V head dim"]


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_shard_unshard_roundtrip(world, tmp_path):
    assert all(run_ranks(rw.shard_roundtrip, world, tmp_path, timeout=120))


def test_error_does_not_grow_with_world_size(tmp_path):
    """bf16: the ring's RMS error at W = 4 is at most 1.25x its error at W = 1 (same inputs)."""
    case = dict(b=1, s=64, h=4, hkv=2, d=64, dtype=torch.bfloat16, causal=True, layout="zigzag", seed=11)
    w4 = run_ranks(rw.battery, 4, tmp_path, [case], timeout=300)[0][0]
    bad = rw.growth_failures(w4, rw.check_case(0, 1, case), 4)
    assert not bad, "\n".join(bad)


def test_ring_single_process_without_distributed():
    """No process group: the ring is a single rank (W = 1)."""
    q, k, v, dout, dlse = rw.random_inputs(1, 33, 3, 1, 24, torch.float64, seed=5)
    for causal in (False, True):
        ours = ring_with_grads(q, k, v, dout, dlse, causal=causal, layout="contiguous", backend="torch")
        ref = attention_with_grads(ringlse.reference_attention, q, k, v, dout, dlse, upcast=True,
                                   causal=causal, q_start=0, k_start=0)
        for name, a, b in zip(rw.NAMES, ours, ref):
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


def test_layout_errors_name_length_world_and_layout():
    with pytest.raises(ValueError, match=r"sequence length 7 .*W=2.*'zigzag'"):
        ringlse.ring.layout.check_layout("zigzag", 7, 2)
    with pytest.raises(ValueError, match="unknown layout"):
        ringlse.ring.layout.check_layout("spiral", 8, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; the GPU suite covers compiled kernels")
def test_ring_with_triton_kernels_under_interpreter(tmp_path):
    """The same loop with the Triton block op: in-kernel merges into strided accumulator views,
    dq/dk/dv accumulation into travelling buffers (fp16/fp32: the interpreter's bf16 dot is wrong)."""
    pytest.importorskip("triton")
    cases = [dict(b=1, s=s, h=4, hkv=2, d=32, dtype=dt, causal=c, layout=lay, seed=3, backend="triton")
             for dt in (torch.float32, torch.float16)
             for lay, c, s in (("zigzag", True, 64), ("stripe", True, 48), ("contiguous", False, 40))]
    per_rank = run_ranks(rw.battery, 2, tmp_path, cases, timeout=400)
    for case, result in zip(cases, per_rank[0]):
        for name, ok, text in result["verdicts"]:
            assert ok, f"{case['dtype']} {case['layout']}: {text}"


def test_ring_with_triton_kernels_in_pieces_under_interpreter(tmp_path):
    """W = 3, where the backward computes dk/dv in pieces of keys (dq alone once per step: the kernels'
    `dq_acc=None` / `dk_acc=dv_acc=None`): 150 local keys, pieces of 64, 64 and 22."""
    pytest.importorskip("triton")
    cases = [dict(b=1, s=450, h=2, hkv=1, d=16, dtype=torch.float32, causal=c, layout=lay, seed=7, backend="triton")
             for lay, c in (("zigzag", True), ("contiguous", False))]
    per_rank = run_ranks(rw.battery, 3, tmp_path, cases, timeout=400)
    for case, result in zip(cases, per_rank[0]):
        for name, ok, text in result["verdicts"]:
            assert ok, f"{case['layout']}: {text}"


def _sdpa_cpu_cases(world: int) -> list[dict]:
    """The `sdpa` op (its CPU kernels here) returns gradients as parts: dk/dv go home as the kernels'
    own tensors where they can (full blocks, no GQA sum, no lse term) and summed in float32 otherwise."""
    unit = 2 * world
    base = dict(b=1, h=4, d=32, seed=6, backend="sdpa_cpu")
    cases = []
    for layout, causal in itertools.product(LAYOUTS, (False, True)):
        # float64 with an lse gradient (summed float64 messages) and GQA
        cases.append(dict(base, s=unit * 3, hkv=2, dtype=torch.float64, causal=causal, layout=layout))
        # float64 without one: the kernels' tensors travel as they are
        cases.append(dict(base, s=unit * 3, hkv=4, dtype=torch.float64, causal=causal, layout=layout, lse_grad=False))
    for layout in LAYOUTS:  # bf16 messages, judged by CONVENTIONS.md §7
        cases.append(dict(base, s=unit * 8, hkv=4, d=64, dtype=torch.bfloat16, causal=True, layout=layout))
    cases.append(dict(base, s=unit * 8, hkv=4, d=64, dtype=torch.bfloat16, causal=True, layout="zigzag",
                      return_lse=True))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_ring_with_gradient_parts_matches_reference(world, tmp_path):
    cases = _sdpa_cpu_cases(world)
    per_rank = run_ranks(rw.battery, world, tmp_path, cases, timeout=300)
    for case, result in zip(cases, per_rank[0]):
        for name, ok, text in result["verdicts"]:
            assert ok, f"W={world} {case}: {text}"


def test_gradient_parts_error_does_not_grow_with_world_size(tmp_path):
    """bf16 dk/dv travelling as the kernels' bf16 outputs: W = 4 RMS error at most 1.25x W = 1."""
    case = dict(b=1, s=128, h=4, hkv=4, d=64, dtype=torch.bfloat16, causal=True, layout="zigzag", seed=12,
                backend="sdpa_cpu")
    w4 = run_ranks(rw.battery, 4, tmp_path, [case], timeout=300)[0][0]
    bad = rw.growth_failures(w4, rw.check_case(0, 1, case), 4)
    assert not bad, "\n".join(bad)


def test_ring_over_subgroups_maps_ranks(tmp_path):
    assert all(run_ranks(rw.subgroup_rings, 4, tmp_path, timeout=240))


def test_nan_inputs_do_not_hang(tmp_path):
    assert all(run_ranks(rw.nan_inputs_finish, 2, tmp_path, timeout=120))


def _masked_cases(world: int) -> list[dict]:
    s = 4 * world * 3  # zigzag needs 2W chunks
    docs = [0, 1, 1, s // 3 + 1, s - 5, s]  # empty, length-1 and rank-crossing documents
    cases = []
    for layout in LAYOUTS:
        for causal, window, bounds in ((True, (-1, -1), docs), (True, (3, -1), None), (False, (2, 4), docs),
                                       (True, (0, 0), docs)):
            cases.append(dict(s=s, layout=layout, causal=causal, window=window, docs=bounds, seed=len(cases)))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_ring_with_windows_and_documents_matches_the_oracle(world, tmp_path):
    per_rank = run_ranks(rw.masked_rings, world, tmp_path, _masked_cases(world), timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_ring_with_documents_on_an_op_without_intervals(world, tmp_path):
    """Documents on the `sdpa` op (its CPU kernels; no intervals): one plain call per document and
    pair of runs, as on one device, in the layouts of contiguous runs (float64, the oracle's)."""
    cases = [dict(c, backend="sdpa_cpu") for c in _masked_cases(world)
             if c["window"] == (-1, -1) and c["layout"] != "stripe"]
    s = cases[0]["s"]
    cases.append(dict(s=s, layout="zigzag", causal=False, window=(-1, -1), docs=[0, s // 2 + 1, s], seed=99,
                      backend="sdpa_cpu"))
    big = 128 * world  # the balanced layout's chunks are 64 tokens at least
    cases.append(dict(s=big, layout="balanced", causal=True, window=(-1, -1), docs=[0, 3, big // 3, big - 40, big],
                      seed=98, backend="sdpa_cpu"))
    per_rank = run_ranks(rw.masked_rings, world, tmp_path, cases, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_ring_with_windows_as_a_rule(world, tmp_path):
    """Windows (with documents) on an op that takes them as a rule, not as intervals (fa4's contract,
    here over exact torch math): per-document calls cut to each window's box, across ranks."""
    cases = [dict(c, backend="window_rule") for c in _masked_cases(world)
             if c["window"] != (-1, -1) and c["layout"] != "stripe"]
    per_rank = run_ranks(rw.masked_rings, world, tmp_path, cases, timeout=300)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures[:10])


def test_ring_refuses_what_an_op_without_intervals_cannot_compute():
    """Windows on an op that takes neither intervals nor windows, and documents in the strided layout
    on one without intervals: ValueError naming what is missing (one rank; every rank raises together
    through the agreement, as `test_ring_faults` checks for such errors)."""
    from ringlse.blocks.sdpa import SDPA_BLOCK_OP

    q = torch.randn(1, 8, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="'stripe' layout need a backend that takes intervals"):
        ringlse.ring_attention(q, q, q, causal=True, layout="stripe", cu_seqlens=[0, 3, 8], backend=SDPA_BLOCK_OP)
    with pytest.raises(ValueError, match="need a backend that takes intervals; the 'sdpa' block op does not"):
        ringlse.ring_attention(q, q, q, causal=True, window_size=(2, 0), backend=SDPA_BLOCK_OP)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run; the GPU suite covers compiled kernels")
def test_ring_with_windows_and_documents_on_triton_kernels(tmp_path):
    """The masked ring through the Triton op (under the interpreter: float32), every layout, W = 2."""
    pytest.importorskip("triton")
    cases = [dict(c, dtype=torch.float32, backend="triton") for c in _masked_cases(2)[::2]]
    per_rank = run_ranks(rw.masked_rings, 2, tmp_path, cases, timeout=400)
    failures = [f for fs in per_rank for f in fs]
    assert not failures, "\n".join(failures[:10])
