"""The `fa4` backend with the real FlashAttention-4 on a GPU (sm90+), against the float64 reference by
CONVENTIONS.md §7: blocks at every kind of offset, windows, documents, accumulators. Skipped without CUDA
or FA4 (`pip install flash-attn-4`)."""

from __future__ import annotations

import pytest
import torch

import ringlse
import ringlse.blocks as registry
from fa4_checks import _block, _qkv, check_against_reference, judge_merged_block
from ringlse.blocks.fa4 import FA4_BLOCK_OP, _interface, _replayed, fa4_mask_args
from ringlse.blocks.fa4_replay import Replayed
from ringlse.reference import reference_attention
from ringlse.testing import assert_judged, naive_attention


def _fa4_on_gpu() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return registry.backend_unavailable_reason("fa4", "cuda", torch.bfloat16)


def gpu_fa4(fn):
    """GPU test with the real FlashAttention-4 (skipped without CUDA, FA4, or below sm90)."""
    why = "FlashAttention-4 cannot run here"
    return pytest.mark.gpu(pytest.mark.skipif("_fa4_on_gpu() is not None", reason=why)(fn))


# (b, sq, sk, h, hkv, d, causal, q_start, k_start)
GPU_CASES = [
    pytest.param((2, 1025, 1025, 8, 8, 128, True, 0, 0), id="diag-s1025-d128"),
    pytest.param((1, 640, 1025, 8, 2, 128, True, 385, 0), id="bottom-right-gqa"),
    pytest.param((1, 1024, 1024, 8, 2, 64, True, 512, 0), id="partial-2pieces-gqa-d64"),
    pytest.param((1, 1025, 640, 8, 2, 128, True, 700, 300), id="offset-gqa"),
    pytest.param((1, 1000, 300, 4, 1, 64, True, 100, 0), id="more-queries-than-keys-mqa"),
    pytest.param((2, 97, 200, 4, 1, 64, True, 100, 150), id="masked-rows-mqa"),
    pytest.param((1, 512, 512, 4, 4, 56, True, 0, 1), id="stripe-d56"),
    pytest.param((1, 512, 640, 8, 2, 128, True, 640, 0), id="off-diagonal-full"),
    pytest.param((1, 640, 1025, 8, 2, 64, False, 0, 0), id="not-causal-gqa-d64"),
]


@gpu_fa4
@pytest.mark.parametrize("case", GPU_CASES)
def test_fa4_gpu(case):
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    check_against_reference(_block("fa4", causal, q_start, k_start), b, sq, sk, h, hkv, d, torch.bfloat16, "cuda",
                            lse_grad=True, seed=sum(case) % 1000, causal=causal, q_start=q_start, k_start=k_start)


@gpu_fa4
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[3]])
def test_fa4_gpu_no_lse_grad_and_flash_resolves_to_fa4(case):
    """Without an lse gradient (dlse=None: FA4 compiles another backward), through `flash`."""
    assert ringlse.get_block_op("flash", "cuda", torch.bfloat16) is FA4_BLOCK_OP
    assert {"fa4", "flash"} <= set(ringlse.available_backends("cuda"))
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    check_against_reference(_block("flash", causal, q_start, k_start), b, sq, sk, h, hkv, d, torch.bfloat16, "cuda",
                            lse_grad=False, seed=4, causal=causal, q_start=q_start, k_start=k_start)


GPU_WINDOW_CASES = [
    pytest.param((1024, 1024, True, (256, -1), None), id="causal-left256"),
    pytest.param((1024, 1024, False, (100, 37), None), id="left100-right37"),
    pytest.param((640, 1025, True, (129, -1), None), id="bottom-right-fewer-queries"),
    pytest.param((1025, 640, False, (3, 2), None), id="more-queries-rows-see-nothing"),
    pytest.param((1024, 1024, True, (200, -1), [0, 300, 300, 777, 1000, 1024]), id="causal-window-documents"),
]


@gpu_fa4
@pytest.mark.parametrize("case", GPU_WINDOW_CASES)
def test_fa4_gpu_windows(case):
    """Windows as FlashAttention-4's own bounds, with the real FA4, against the float64 reference."""
    sq, sk, causal, window, docs = case

    def run(q, k, v):
        return ringlse.attention(q, k, v, causal=causal, window_size=window, cu_seqlens=docs, return_lse=True,
                                 backend="fa4")

    check_against_reference(run, 1, sq, sk, 8, 2, 128, torch.bfloat16, "cuda", lse_grad=True, seed=sq + sk,
                            causal=causal, window_size=window, cu_seqlens=docs)

    def chunked(q, k, v):
        return ringlse.chunked_attention(q, k, v, causal=causal, window_size=window, cu_seqlens=docs,
                                         chunk_size=384, return_lse=True, backend="fa4")

    check_against_reference(chunked, 1, sq, sk, 8, 2, 64, torch.bfloat16, "cuda", lse_grad=False, seed=7,
                            causal=causal, window_size=window, cu_seqlens=docs)


@gpu_fa4
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fa4_gpu_documents(causal):
    bounds = [0, 300, 300, 777, 1000, 1024]

    def run(q, k, v):
        return ringlse.attention(q, k, v, causal=causal, cu_seqlens=bounds, return_lse=True, backend="fa4")

    check_against_reference(run, 1, 1024, 1024, 8, 2, 128, torch.bfloat16, "cuda", lse_grad=True, seed=6,
                            causal=causal, cu_seqlens=bounds)


@gpu_fa4
def test_fa4_gpu_accumulators():
    b, sq, sk, h, hkv, d, q_start, k_start = 1, 1025, 640, 8, 2, 128, 700, 300
    gen = torch.Generator().manual_seed(22)
    q, k, v = (x.detach() for x in _qkv(b, sq, sk, h, hkv, d, torch.bfloat16, "cuda", gen))
    out_acc = torch.randn(b, sq, h, d, generator=gen).cuda()
    lse_acc = (torch.randn(b, h, sq, generator=gen) * 2).cuda()
    state0 = (out_acc.clone().double(), lse_acc.clone().double())
    FA4_BLOCK_OP.forward(q, k, v, softmax_scale=d**-0.5, causal=True, q_start=q_start, k_start=k_start,
                         out_acc=out_acc, lse_acc=lse_acc)
    judge_merged_block(out_acc, lse_acc, state0, q, k, v, q_start, k_start, torch.bfloat16)


@gpu_fa4
@pytest.mark.parametrize("q_start,causal,window", [(512, True, (-1, -1)), (1024, True, (-1, -1)), (0, False, (100, 50))],
                         ids=["partial", "full", "window"])
def test_fa4_gpu_mask_args_match_the_rule(q_start, causal, window):
    """FA4's own windows (bare `flash_attn_func`) with `fa4_mask_args`, as the benchmark calls it."""
    from flash_attn.cute import flash_attn_func

    gen = torch.Generator().manual_seed(7)
    sq = sk = 1024
    q = torch.randn(1, sq, 8, 128, generator=gen).cuda().bfloat16()
    k, v = (torch.randn(1, sk, 2, 128, generator=gen).cuda().bfloat16() for _ in "kv")
    fa4_causal, ws = fa4_mask_args(sq, sk, q_start, 0, causal, window)
    out, lse = flash_attn_func(q, k, v, causal=fa4_causal, window_size=ws, return_lse=True)
    rule = dict(causal=causal, q_start=q_start, k_start=0, window_size=window)
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), **rule)
    b_out, b_lse = naive_attention(q, k, v, **rule)
    assert_judged("out", out, ref_out, b_out, torch.bfloat16)
    assert_judged("lse", lse, ref_lse, b_lse, torch.bfloat16, is_lse=True)


# (d_qk, d_v, softcap, q_start, k_start): Gemma 2's cap, DeepSeek-V3's head dims, both; causal at offsets
# where the first rows see nothing (FA4's two pieces) and an off-diagonal block (one call with a band)
FEATURE_CASES = [
    pytest.param((128, 128, 30.0, 0, 0), id="softcap-diagonal"),
    pytest.param((128, 128, 50.0, 0, 9), id="softcap-empty-rows"),
    pytest.param((192, 128, 0.0, 0, 0), id="dv-diagonal"),
    pytest.param((192, 128, 0.0, 700, 300), id="dv-offset"),
    pytest.param((192, 128, 30.0, 0, 9), id="dv-softcap-empty-rows"),
]


@gpu_fa4
@pytest.mark.parametrize("case", FEATURE_CASES)
def test_fa4_gpu_softcap_and_v_head_dim(case):
    """`softcap` and Q/K 192 / V 128 go to FA4 natively: out, lse and gradients (with an lse gradient, the
    ring's use) of a bf16 causal block at offsets, judged by CONVENTIONS.md §7 against the float64 oracle of
    tests/test_kernels_softcap_dv.py (its bf16 run is the baseline)."""
    _check_softcap_dv(case, seed=sum(case[:2]))


def _check_softcap_dv(case, seed: int) -> None:
    from test_kernels_softcap_dv import _draw, _judge, causal_mask, oracle

    d, dv, softcap, q_start, k_start = case
    sq, sk, h, hkv = 1000, 1031, 4, 2
    q, k, v, dout = _draw(1, sq, sk, h, hkv, d, dv, torch.bfloat16, "cuda", seed=seed)
    dlse = torch.randn(1, h, sq, generator=torch.Generator().manual_seed(5), dtype=torch.float64).cuda()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = ringlse.block_attention(*leaves, causal=True, q_start=q_start, k_start=k_start, softcap=softcap,
                                       backend="fa4")
    loss = (out.double() * dout.double()).sum() + (torch.where(torch.isfinite(lse), lse, 0.0).double() * dlse).sum()
    ours = [out, lse, *torch.autograd.grad(loss, leaves)]
    mask = causal_mask(sq, sk, q_start, k_start)
    kw = dict(scale=d ** -0.5, softcap=softcap, mask=mask, dlse=dlse)
    ref, base = oracle(q, k, v, dout, **kw), oracle(q, k, v, dout, dtype=torch.bfloat16, **kw)
    assert out.shape == (1, sq, h, dv)
    _judge(ours, ref, base, torch.bfloat16)


@gpu_fa4
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[1], GPU_CASES[8]])
def test_fa4_gpu_replayed_calls(case, monkeypatch):
    """From a signature's third call on, FA4's calls are replayed from a recorded plan (`fa4_replay`):
    three calls with an lse gradient and three without, fresh inputs each, each judged against the float64
    reference as above (so forwards and backwards of both kinds are replayed and judged), and the replayed
    forward bit for bit FA4's own."""
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    fwd, bwd = _replayed(_interface())
    replays = {fwd: 0, bwd: 0}
    real = Replayed._replay

    def counted(entry, plan, inputs):
        replays[entry] = replays.get(entry, 0) + 1
        return real(entry, plan, inputs)

    monkeypatch.setattr(Replayed, "_replay", counted)
    for seed in range(6):
        check_against_reference(_block("fa4", causal, q_start, k_start), b, sq, sk, h, hkv, d, torch.bfloat16, "cuda",
                                lse_grad=seed < 3, seed=seed, causal=causal, q_start=q_start, k_start=k_start)
    assert replays[fwd] >= 4 and replays[bwd] >= 2, replays
    q, k, v = _qkv(b, sq, sk, h, hkv, d, torch.bfloat16, "cuda", torch.Generator().manual_seed(9))
    for _ in range(3):
        ours = fwd(q, k, v, softmax_scale=0.1, causal=causal, return_lse=True)
        own = _interface()._flash_attn_fwd(q, k, v, softmax_scale=0.1, causal=causal, return_lse=True)
        assert torch.equal(ours[0], own[0]) and torch.equal(ours[1], own[1])


@gpu_fa4
@pytest.mark.parametrize("case", [FEATURE_CASES[1], FEATURE_CASES[4]])
def test_fa4_gpu_replayed_softcap_and_v_head_dim(case, monkeypatch):
    """The softcap and Q/K 192 / V 128 calls replayed: three calls of `test_fa4_gpu_softcap_and_v_head_dim`,
    the third replayed forward and backward."""
    replays = []
    real = Replayed._replay
    monkeypatch.setattr(Replayed, "_replay", lambda entry, plan, inputs: replays.append(entry) or real(entry, plan, inputs))
    for seed in range(3):
        _check_softcap_dv(case, seed=seed)
    assert len(replays) >= 2
