"""Ring attention on spawned NCCL ranks (one per GPU) vs the float64 reference on the full sequence,
for every GPU backend, by CONVENTIONS.md §7. Needs 2+ GPUs (4 for the W=4 cases)."""

from __future__ import annotations

import itertools

import pytest
import torch

import ring_workers as rw
from dist_harness import run_ranks
from ringlse.blocks import available_backends

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def _gpu_backends() -> list[str]:
    return [b for b in ("triton", "sdpa", "flash") if torch.cuda.is_available() and b in available_backends("cuda")]


def _cases(world: int, backend: str) -> list[dict]:
    unit = 2 * world * 64  # divides in every layout, several kernel tiles per rank
    cases = []
    for dtype, layout, causal in itertools.product((torch.bfloat16, torch.float16), ("contiguous", "zigzag", "stripe"),
                                                   (False, True)):
        cases.append(dict(b=1, s=unit * 2, h=8, hkv=2, d=128, dtype=dtype, causal=causal, layout=layout, seed=21,
                          backend=backend))
    cases.append(dict(b=2, s=unit, h=4, hkv=4, d=64, dtype=torch.bfloat16, causal=True, layout="zigzag", seed=22,
                      backend=backend))
    # without GQA the sdpa/flash ops' bf16 dk/dv travel home as they are; with the lse returned, in float32
    for layout, return_lse in (("zigzag", False), ("stripe", False), ("zigzag", True)):
        cases.append(dict(b=1, s=unit * 2, h=8, hkv=8, d=128, dtype=torch.bfloat16, causal=True, layout=layout,
                          seed=23, backend=backend, return_lse=return_lse))
    return cases


def _world_sizes() -> list[int]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [w for w in (2, 3, 4) if w <= n] or [2]


@pytest.mark.parametrize("backend", ["triton", "sdpa", "flash"])
@pytest.mark.parametrize("world", _world_sizes(), ids=lambda w: f"W{w}")
def test_ring_gpu_matches_reference(world, backend, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available")
    cases = _cases(world, backend)
    per_rank = run_ranks(rw.battery, world, tmp_path, cases, timeout=500, backend="nccl")
    for case, result in zip(cases, per_rank[0]):
        for name, ok, text in result["verdicts"]:
            assert ok, f"W={world} {backend} {case['dtype']} {case['layout']} causal={case['causal']}: {text}"


@pytest.mark.parametrize("backend, hkv", [("triton", 2), ("triton", 8), ("sdpa", 2), ("sdpa", 8)],
                         ids=["triton-hkv2", "triton-hkv8", "sdpa-hkv2", "sdpa-hkv8"])
def test_ring_gpu_error_does_not_grow_with_world_size(backend, hkv, tmp_path):
    """RMS error at W = 4 at most 1.25x W = 1 (CONVENTIONS.md §7), on three seeds; every result within its bound."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    if backend not in _gpu_backends():
        pytest.skip(f"backend {backend} not available")
    cases = [dict(b=1, s=8 * 256, h=8, hkv=hkv, d=128, dtype=torch.bfloat16, causal=True, layout="zigzag", seed=seed,
                  backend=backend) for seed in (31, 32, 33)]
    w4 = run_ranks(rw.battery, 4, tmp_path, cases, timeout=300, backend="nccl")[0]
    w1 = run_ranks(rw.battery, 1, tmp_path, cases, timeout=300, backend="nccl")[0]
    bad = [f"seed {c['seed']}: {b}" for c, many, one in zip(cases, w4, w1) for b in rw.growth_failures(many, one, 4)]
    assert not bad, f"{backend} hkv={hkv}:\n" + "\n".join(bad)


@pytest.mark.parametrize("world", _world_sizes(), ids=lambda w: f"W{w}")
def test_ring_gpu_bad_inputs_raise_on_every_rank(world, tmp_path):
    """On NCCL too (the agreement goes through a gloo group of the same ranks): every rank raises
    ValueError, nobody hangs, and the group still works afterwards."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    per_rank = run_ranks(rw.expect_value_errors, world, tmp_path, 3, timeout=180, backend="nccl")
    for rank, results in enumerate(per_rank):
        for name, raised, message in results:
            assert raised, f"W={world} rank {rank}: {name}: {message}"


# windows shorter than a shard (owner-to-reader route), documents crossing the ranks' boundaries
MASKED = [
    dict(causal=True, window=(100, 0), docs=None),
    dict(causal=True, window=(-1, -1), docs=[0, 300, 301, 700, 1024]),
    dict(causal=False, window=(37, 50), docs=[0, 1, 600, 1024]),
    dict(causal=True, window=(600, 0), docs=[0, 512, 1024]),
]


@pytest.mark.parametrize("backend", ["triton", "fa4"])
def test_ring_gpu_softcap_and_v_head_dim(backend, tmp_path):
    """Gemma 2's softcap and DeepSeek-V3's head dims (Q/K 192, V 128) in a bf16 ring of 2 GPUs, zigzag and
    contiguous, forward and backward with an lse gradient, judged against the float64 oracle."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if backend not in available_backends("cuda"):
        pytest.skip(f"backend {backend} not available")
    cases = [dict(s=2048, d=128, dv=128, softcap=30.0, layout="zigzag", seed=31, backend=backend),
             dict(s=2048, d=192, dv=128, softcap=0.0, layout="contiguous", seed=32, backend=backend),
             dict(s=2048, d=192, dv=128, softcap=30.0, layout="zigzag", seed=33, backend=backend)]
    failures = run_ranks(rw.ring_features, 2, tmp_path, cases, timeout=400, backend="nccl")[0]
    assert failures == [], "\n".join(failures)


@pytest.mark.parametrize("transport", ["copy", "nccl"])
@pytest.mark.parametrize("world", _world_sizes(), ids=lambda w: f"W{w}")
def test_ring_gpu_windows_and_documents(world, transport, tmp_path, monkeypatch):
    """Masked rings over NCCL ranks against the dense-mask float64 oracle, every layout, forward and
    backward: the `torch` op in float64 (exact) and the `triton` op in float32 (CONVENTIONS.md §7),
    K/V pulled by copy engines or sent by NCCL (the owner-to-reader route where the mask allows)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    monkeypatch.setenv("RINGLSE_KV_TRANSPORT", transport)  # the spawned ranks inherit it
    s = 1024 if 1024 % (2 * world) == 0 else 1032  # every layout divides it; the last document ends there
    cases = [dict(s=s, layout=layout, seed=40 + i, **{**m, "docs": m["docs"] and [*m["docs"][:-1], s]}, **dt)
             for i, (m, layout) in enumerate(itertools.product(MASKED, ("contiguous", "zigzag", "stripe")))
             for dt in (dict(dtype=torch.float64, backend="torch"), dict(dtype=torch.float32, backend="triton", d=64))]
    failures = [f for fs in run_ranks(rw.masked_rings, world, tmp_path, cases, timeout=400, backend="nccl") for f in fs]
    assert not failures, "\n".join(failures[:10])


# (victim's fault, ring timeout=, RINGLSE_KV_TRANSPORT, a good ring call first, the group's timeout, phases the
# survivor may name, bound in seconds, ranks: 2 unless said). From W = 3 the backward's dk/dv messages travel by
# copy engine too (`ringlse.ring.dkv_pull`): rank 0 waits for the dead rank 1's message at step 1. Before the
# group's first ring call its gloo twin (the agreement's group) does not exist yet, and a dead member never
# joins it: the survivor waits the group's timeout.
NCCL_FAULTS = {
    "exit-before-first-agreement": ("agreement", None, "nccl", False, 20.0, {"agreement"}, 20.0 + 10.0),
    "exit-before-agreement": ("agreement", None, "nccl", True, 60.0, {"agreement"}, 10.0),
    "exit-in-forward-nccl": ("forward", 5.0, "nccl", True, 60.0, {"forward", "backward"}, 5.0 + 10.0),
    "exit-in-backward-nccl": ("backward", 5.0, "nccl", True, 60.0, {"backward"}, 5.0 + 10.0),
    "exit-in-forward-copy": ("forward", 5.0, "copy", True, 60.0, {"forward", "backward"}, 5.0 + 10.0),
    "exit-in-backward-copy-W3": ("backward", 5.0, "copy", True, 60.0, {"backward"}, 5.0 + 10.0, 3),
}


@pytest.mark.parametrize("name", list(NCCL_FAULTS))
def test_ring_gpu_dead_rank_raises_on_the_survivor(name, tmp_path, monkeypatch):
    """A rank of a W = 2 (or 3) NCCL ring exits: the survivor (rank 0) raises `RuntimeError` naming the
    phase, the step and the dead peer within `timeout=` plus a few seconds (the agreement runs on a gloo twin, which
    notices a closed connection at once), returns no result, and refuses later calls on the group."""
    where, timeout, transport, warm, pg_timeout, phases, bound, *world = NCCL_FAULTS[name]
    world = world[0] if world else 2
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    monkeypatch.setenv("RINGLSE_KV_TRANSPORT", transport)
    got = run_ranks(rw.ring_fault, world, tmp_path, 1, where, "exit", timeout, 0.0, warm, backend="nccl",
                    pg_timeout=pg_timeout, may_exit=[1], hard_exit=True, timeout=bound + 30)[0]
    assert not got["returned"] and got["type"] == "RuntimeError", f"{name}: {got}"
    m = rw.FAULT_RE.match(got["message"])
    assert m and m.group(1) in phases and m.group(3) == "rank 1", f"{name}: {got['message']!r}"
    assert got["elapsed"] < bound, f"{name}: raised after {got['elapsed']:.1f} s (bound {bound} s)"
    again = got["again"]
    assert again["type"] == "RuntimeError" and "earlier call on this process group failed" in again["message"]
