"""Head parallelism x ring (`ring_attention(..., group=, head_group=)`, CONVENTIONS.md §5.1) on spawned
gloo ranks, float64, against the dense oracle on the full sequence (`mask_oracle.oracle`), forward and
backward (dq/dk/dv unsharded; d sinks summed over the ranks). One pool of ranks per world size (4 and
6) runs every case, U x R grids built once per pool (`head_parallel_workers.grid`)."""

from __future__ import annotations

import pytest
import torch

import head_parallel_workers as hw
from dist_harness import RankPool, run_ranks
from ringlse.ring.head_split import HeadSplit


@pytest.fixture(scope="module")
def pool4(tmp_path_factory):
    with RankPool(4, tmp_path_factory.mktemp("hp4")) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool6(tmp_path_factory):
    with RankPool(6, tmp_path_factory.mktemp("hp6")) as pool:
        yield pool


@pytest.mark.parametrize("h, hkv, size, heads", [
    pytest.param(8, 2, 2, (0, 1), id="8/2-U2-as-is"),
    pytest.param(8, 8, 4, tuple(range(8)), id="8/8-U4-as-is"),
    pytest.param(12, 4, 2, (0, 1, 2, 3), id="12/4-U2-as-is"),
    pytest.param(8, 1, 2, (0, 0), id="8/1-U2-one-each"),
    pytest.param(8, 2, 4, (0, 0, 1, 1), id="8/2-U4-one-each"),
    pytest.param(6, 2, 3, (0, 0, 0, 1, 1, 1), id="6/2-U3-one-per-query-head"),
])
def test_head_split_keeps_the_gqa_rule(h, hkv, size, heads):
    split = HeadSplit.of(h, hkv, size)
    assert split.kv_heads == heads and split.kv_split_as_is == (heads == tuple(range(hkv)))
    hu, m = h // size, split.kv_per_rank
    for u in range(size):  # local query head t reads local K/V head t // (hu / m), the global rule's kv head
        for t in range(hu):
            assert split.kv_heads[u * m + t // (hu // m)] == (u * hu + t) // (h // hkv)


def test_heads_that_do_not_divide_are_refused_by_name():
    with pytest.raises(ValueError, match=r"nheads \(6\) does not divide over the head group's U=4"):
        HeadSplit.of(6, 2, 4)


CASES4 = [
    pytest.param(dict(U=2, R=2, s=32, h=4, hkv=2, layout="zigzag", causal=True, b=2, seed=1),
                 id="2x2-causal-zigzag-gqa4/2-batch2"),
    pytest.param(dict(U=4, R=1, s=32, h=8, hkv=2, layout="contiguous", causal=True, seed=2),
                 id="4x1-causal-gqa8/2-kv-repeated"),
    pytest.param(dict(U=1, R=4, s=32, h=8, hkv=2, layout="zigzag", causal=True, seed=3), id="1x4-causal-zigzag"),
    pytest.param(dict(U=2, R=2, s=32, h=8, hkv=1, layout="stripe", causal=True, window=(5, 0), seed=4),
                 id="2x2-window-stripe-gqa8/1"),
    pytest.param(dict(U=2, R=2, s=40, h=8, hkv=2, layout="zigzag", causal=True, docs=[0, 7, 7, 23, 40], seed=5),
                 id="2x2-documents-zigzag-gqa8/2"),
    pytest.param(dict(U=2, R=2, s=32, h=4, hkv=4, layout="contiguous", causal=False, window=(3, 2), sinks=True,
                      seed=6), id="2x2-window-sinks-contiguous"),
    pytest.param(dict(U=4, R=1, s=32, h=8, hkv=1, layout="stripe", causal=False, docs=[0, 10, 32], seed=7),
                 id="4x1-documents-gqa8/1"),
    pytest.param(dict(U=2, R=2, s=256, h=4, hkv=2, layout="balanced", causal=True, docs=[0, 9, 140, 200, 256],
                      seed=8), id="2x2-documents-balanced"),
]


@pytest.mark.parametrize("case", CASES4)
def test_four_ranks_match_the_oracle(pool4, case):
    assert [f for fs in pool4.run(hw.match_oracle, case) for f in fs] == []


CASES6 = [
    pytest.param(dict(U=2, R=3, s=48, h=8, hkv=2, layout="zigzag", causal=True, seed=11), id="2x3-causal-zigzag"),
    pytest.param(dict(U=3, R=2, s=48, h=6, hkv=2, layout="stripe", causal=True, docs=[0, 13, 30, 48], sinks=True,
                      b=2, seed=12), id="3x2-documents-sinks-gqa6/2-batch2"),
    pytest.param(dict(U=3, R=2, s=48, h=6, hkv=1, layout="contiguous", causal=True, window=(6, 0), seed=13),
                 id="3x2-window-gqa6/1"),
    pytest.param(dict(U=2, R=3, s=48, h=4, hkv=4, layout="zigzag", causal=True, sinks=True, return_lse=False,
                      seed=14), id="2x3-sinks-out-only"),
]


@pytest.mark.parametrize("case", CASES6)
def test_six_ranks_match_the_oracle(pool6, case):
    assert [f for fs in pool6.run(hw.match_oracle, case) for f in fs] == []


# NCCL ranks on 4 GPUs, float32 through the `triton` op (and `fa4` in bf16 where it runs is left to the ring's
# own GPU tests): the all-to-alls and the ring's transports on real devices
GPU_CASES = [
    dict(U=2, R=2, s=512, h=8, hkv=2, d=64, layout="zigzag", causal=True, sinks=True, seed=21),
    dict(U=4, R=1, s=512, h=8, hkv=1, d=64, layout="contiguous", causal=True, window=(100, 0), seed=22),
    dict(U=2, R=2, s=512, h=4, hkv=2, d=64, layout="balanced", causal=True, docs=[0, 37, 300, 512], seed=23),
]


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_ranks_on_four_gpus_match_the_oracle(tmp_path):
    """2x2 and 4x1 grids of NCCL ranks (one per GPU), float32 `triton`, causal, window, documents in the
    balanced layout, sinks, GQA: within CONVENTIONS.md §7's float32 bound of the float64 oracle."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    cases = [dict(c, cuda=True, dtype=torch.float32, backend="triton") for c in GPU_CASES]
    failures = run_ranks(hw.match_oracle_cases, 4, tmp_path, cases, timeout=400, backend="nccl")[0]
    assert failures == []


def test_heads_not_dividing_over_u_raise_the_same_error_on_every_rank(pool4):
    got = pool4.run(hw.refusal, dict(U=2, R=2, h=5, hkv=1, bad="heads"))
    assert {g["type"] for g in got} == {"ValueError"}
    assert len({g["message"] for g in got}) == 1, got
    assert "nheads (5) does not divide over the head group's U=2" in got[0]["message"]
    assert all(g["after"] == (1, 4, 6, 8) for g in got)  # the groups still carry a call


def test_one_bad_rank_stops_every_rank_of_both_groups(pool4):
    got = pool4.run(hw.refusal, dict(U=2, R=2, h=4, hkv=2, bad="dtype", bad_rank=1))
    assert {g["type"] for g in got} == {"ValueError"}, got
    assert all("must share a dtype" in g["message"] for g in got), got
    assert all(g["after"] == (1, 4, 6, 8) for g in got)


def test_six_ranks_refuse_heads_that_do_not_divide(pool6):
    got = pool6.run(hw.refusal, dict(U=3, R=2, h=8, hkv=2, bad="heads"))
    assert {g["type"] for g in got} == {"ValueError"} and len({g["message"] for g in got}) == 1, got


def test_shard_unshard_roundtrip(pool4, pool6):
    assert all(pool4.run(hw.roundtrip, [(2, 2), (4, 1), (1, 4)]))
    assert all(pool6.run(hw.roundtrip, [(2, 3), (3, 2)]))


def test_rings_whose_ranks_hold_other_heads_are_refused(pool4):
    got = pool4.run(hw.crossed_groups)
    assert {g["type"] for g in got} == {"ValueError"}, got
    assert all("head group (rank, size)" in g["message"] for g in got), got


def test_a_dead_rank_surfaces_as_the_rings_faults(tmp_path):
    """Rank 3 of a 2 x 2 grid exits before the call: every survivor raises the ring's RuntimeError (the
    phase and the rank it waited for) within a few timeouts, none hangs."""
    got = run_ranks(hw.dead_rank, 4, tmp_path, 3, 2.0, may_exit=(3,), hard_exit=True, pg_timeout=30, timeout=120)
    for rank, g in enumerate(got[:3]):
        assert not g["returned"] and g["type"] == "RuntimeError", (rank, g)
        assert g["message"].startswith("ring_attention: agreement step 0: waiting for rank"), (rank, g)
        assert g["elapsed"] < 12, (rank, g)


def _cost_model():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "head_parallel_cost.py"
    spec = importlib.util.spec_from_file_location("head_parallel_cost", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_cost_model_formulas():
    """benchmarks/head_parallel_cost.py: free links give efficiency 1; at the crossover length a flat ring's
    forward step computes exactly as long as its transfer takes; more nodes never help a network-bound
    flat ring's efficiency."""
    m = _cost_model()
    rates = (635e12, 509e12)
    free = m.Link(0.0, float("inf"))
    for shape in (m.Shape(8192), m.Shape(4096, 8)):
        fwd, bwd = m.compute_s(shape, 16, rates)
        assert m.ring_pass_s(fwd, 16, free, shape.kv_bytes()) == pytest.approx(fwd)
    link = m.Link(0.0, 50e9)
    shape = m.Shape(round(m.crossover_tokens(32, rates, link)))  # the forward's bound here (635 / 509 > 2.4 / 2)
    assert m.compute_s(shape, 8, rates)[0] / 8 == pytest.approx(link.seconds(shape.kv_bytes()), rel=1e-3)
    effs = [m.flat_ring(m.Shape(8192), nodes, rates) for nodes in (2, 4, 8)]
    assert effs == sorted(effs, reverse=True) and all(e < 0.5 for e in effs)


def test_cost_model_doc_holds_the_table():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "head_parallel_cost.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hybrid_benchmark_plans_records_and_plots(tmp_path, monkeypatch):
    """benchmarks/ring.py --hybrid without a GPU: its grids, its records (ring.py's fields, which
    report.py lists as a ring section) and its plot."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    import ring_hybrid as rh

    assert rh.grids(4) == [(2, 2), (1, 4), (4, 1)] and rh.grids(8) == [(2, 4), (1, 8), (8, 1)]
    records: list[dict] = []
    for (u, r), ms in (((2, 2), 10.0), ((1, 4), 9.0), ((4, 1), 12.0)):
        rh.record(records, 4, f"ringlse-triton {u}x{r}", 32768, 1, 32, 128, ms, 30.0, grid=[u, r])
    rh.record(records, 4, "torch-cp", 32768, 1, 32, 128, 11.0, 28.0, rotate="alltoall", per_rotate={})
    rh.record(records, 4, "ringlse-triton 2x2", 32768, 1, 32, 128, None, None, grid=[2, 2], error="RuntimeError: x")
    rh.with_ratios(records)
    assert records[0]["efficiency"] == pytest.approx(30.0 / 40.0)
    assert records[0]["time_ratio_to_torch_cp"] == pytest.approx(10.0 / 11.0)
    rh.plot(records, tmp_path / "ring_hybrid.png", 4, "NVIDIA H100 80GB HBM3")
    assert (tmp_path / "ring_hybrid.png").stat().st_size > 0
    env = dict(gpu="NVIDIA H100 80GB HBM3", gpus=4, torch="2.13", triton="3.6", command="torchrun", date="")
    (tmp_path / "ring_hybrid-4xH100-80GB-HBM3.json").write_text(json.dumps(dict(environment=env, records=records)))
    proc = subprocess.run([sys.executable, str(bench / "report.py"), "--results", str(tmp_path), "--stdout",
                           "--readme", ""], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "| ringlse-triton 2x2 | 32768 |" in proc.stdout, proc.stdout + proc.stderr
