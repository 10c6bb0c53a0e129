"""Model coverage in the kernels: logit softcapping and a V head dim of its own, through the kernel launchers.

The oracle is written here (float64 PyTorch, autograd for the gradients): scores `scale * q.k`, capped as
`softcap * tanh(s / softcap)`, masked, softmax with the lse over the capped scores; rows that see no key
give out 0 and lse -inf. Judged by CONVENTIONS.md §7 (`ringlse.testing.judge`): float32 within
`1e-3 * max|ref|`, 16-bit against the same oracle run in the input dtype (the naive baseline).

CPU tests run the portable kernels under Triton's interpreter (float32/float16: the interpreter's bf16
dots are wrong), on small shapes. GPU tests (`gpu`) run bf16 through whatever kernel the launchers pick on
the GPU at hand (on sm_90: the Gluon kernels where they apply).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ringlse.testing import assert_judged  # noqa: E402
from ringlse.kernels.attention_bwd import attention_backward, attention_delta  # noqa: E402
from ringlse.kernels.attention_fwd import attention_forward  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _draw(b, sq, sk, h, hkv, d, dv, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, h, dv))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for s in shapes]


def causal_mask(sq, sk, q_start, k_start):
    """`[sq, sk]`: key j visible to query i iff k_start + j <= q_start + i (CONVENTIONS.md §4)."""
    return (k_start + torch.arange(sk))[None, :] <= (q_start + torch.arange(sq))[:, None]


def window_intervals(sq, sk, offset, window, device):
    """A causal sliding window at global offset `offset` (query i at key position i + offset): query i
    sees keys `[i + offset - window + 1, i + offset + 1)` clipped to the block, the dk/dv kernel's inverse
    intervals from the mask, and the mask."""
    i = torch.arange(sq)
    lo = (i + offset - window + 1).clamp(0, sk)
    hi = (i + offset + 1).clamp(0, sk)
    mask = (torch.arange(sk)[None, :] >= lo[:, None]) & (torch.arange(sk)[None, :] < hi[:, None])
    seen = mask.any(0)
    rows = torch.arange(sq)[:, None].expand(sq, sk)
    q_lo = torch.where(mask, rows, sq).min(0).values.where(seen, torch.zeros(()).long())
    q_hi = torch.where(mask, rows + 1, 0).max(0).values.where(seen, torch.zeros(()).long())
    bounds = [t.to(device=device, dtype=torch.int32) for t in (lo, hi, q_lo, q_hi)]
    return bounds, mask


def oracle(q, k, v, dout, *, scale, softcap, mask, dtype=torch.float64, dlse=None):
    """`(out, lse, dq, dk, dv)` of softcapped attention computed in `dtype` (float64: the reference; the
    input dtype: the §7 baseline), under the loss `out·dout` (`+ lse·dlse` on finite lse with `dlse`). Masked pairs get a huge finite negative score (exp gives exactly 0)
    and rows that see nothing are set to (0, -inf) afterwards, so autograd never meets inf - inf."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask.to(s.device), torch.finfo(dtype).min / 4)
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), vv)
    if mask is not None:
        empty = ~mask.to(s.device).any(1)
        out = out.masked_fill(empty[None, :, None, None], 0.0)
        lse = lse.masked_fill(empty, float("-inf"))
    loss = (out * dout.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse.to(dtype)).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


NAMES = ("out", "lse", "dq", "dk", "dv")


def _judge(ours, ref, base, dtype):
    for name, a, r, b_ in zip(NAMES, ours, ref, base):
        assert_judged(name, a, r, b_, dtype, is_lse=name == "lse")


def run_block(q, k, v, dout, *, scale, softcap, causal=False, q_start=0, k_start=0, bounds=None):
    """Forward and backward of one block through the launchers: `(out, lse, dq, dk, dv)`."""
    kw = dict(softmax_scale=scale, causal=causal, q_start=q_start, k_start=k_start, softcap=softcap)
    fwd_iv = dict(key_lo=bounds[0], key_hi=bounds[1]) if bounds else {}
    out, lse = attention_forward(q, k, v, **kw, **fwd_iv)
    bwd_iv = dict(key_lo=bounds[0], key_hi=bounds[1], query_lo=bounds[2], query_hi=bounds[3]) if bounds else {}
    accs = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v)]
    attention_backward(dout, q, k, v, out, lse, attention_delta(dout, out), **kw, dq_acc=accs[0], dk_acc=accs[1],
                       dv_acc=accs[2], **bwd_iv)
    return [out, lse, *accs]


def check_block(dtype, device, *, d, dv, softcap, sq=97, sk=97, mask_kind="none", h=2, hkv=1, scale=None, seed=0):
    q, k, v, dout = _draw(1, sq, sk, h, hkv, d, dv, dtype, device, seed)
    scale = d ** -0.5 if scale is None else scale
    kw, bounds = {}, None
    if mask_kind == "none":
        mask = None
    elif mask_kind == "causal":
        # keys start 9 positions after the queries: the first 9 rows see nothing (out 0, lse -inf)
        kw = dict(causal=True, q_start=0, k_start=9)
        mask = causal_mask(sq, sk, 0, 9)
    else:
        bounds, mask = window_intervals(sq, sk, -5, 40, device)
    ours = run_block(q, k, v, dout, scale=scale, softcap=softcap, bounds=bounds, **kw)
    ref = oracle(q, k, v, dout, scale=scale, softcap=softcap, mask=mask)
    base = oracle(q, k, v, dout, scale=scale, softcap=softcap, mask=mask, dtype=dtype) if dtype != torch.float32 \
        else [None] * 5
    assert ours[0].shape == (1, sq, h, dv) and ours[4].shape == v.shape
    if mask is not None:
        empty = ~mask.any(1)
        assert torch.isneginf(ours[1][:, :, empty.to(ours[1].device)]).all()
    _judge(ours, ref, base, dtype)


# (d_qk, d_v) x softcap x mask x dtype, chosen so every value of each appears with the others' variety while
# the interpreter stays cheap
CASES = [
    ((64, 64), 5.0, "none", torch.float32),
    ((64, 64), 30.0, "causal", torch.float16),
    ((64, 64), 0.0, "intervals", torch.float16),
    ((128, 64), 5.0, "causal", torch.float32),
    ((128, 64), 0.0, "none", torch.float16),
    ((128, 64), 30.0, "intervals", torch.float32),
    ((192, 128), 30.0, "none", torch.float32),
    ((192, 128), 5.0, "intervals", torch.float16),
    ((192, 128), 0.0, "causal", torch.float32),
    ((80, 80), 5.0, "causal", torch.float16),
    ((80, 80), 30.0, "intervals", torch.float32),
]


@pytest.mark.parametrize("dims,softcap,mask_kind,dtype", CASES)
def test_block_forward_backward(dims, softcap, mask_kind, dtype, device):
    """Forward and gradients of one block, GQA (2 query heads per kv head), odd lengths (97)."""
    check_block(dtype, device, d=dims[0], dv=dims[1], softcap=softcap, mask_kind=mask_kind)


def test_negative_scale_with_softcap(device):
    """A negative scale runs on -q; the cap is odd in the score, so it stays exact."""
    check_block(torch.float32, device, d=64, dv=64, softcap=5.0, sq=40, sk=33, scale=-0.2)


@pytest.mark.parametrize("dims,softcap,dtype", [((64, 64), 5.0, torch.float32), ((192, 128), 30.0, torch.float16)])
def test_merge_two_blocks(dims, softcap, dtype, device):
    """Two key blocks merged into a running state (the first `fresh`, the second merged in the kernel)
    equal the capped attention over all keys; the backward of each block with the global lse adds up to
    the full gradients (the ring's use)."""
    d, dv = dims
    sq, sk1, sk2, scale = 45, 33, 31, d ** -0.5
    q, k, v, dout = _draw(1, sq, sk1 + sk2, 2, 1, d, dv, dtype, device, seed=3)
    ks, vs = (k[:, :sk1], k[:, sk1:]), (v[:, :sk1], v[:, sk1:])
    out_acc = torch.full((1, sq, 2, dv), float("nan"), dtype=torch.float32, device=device)
    lse_acc = torch.full((1, 2, sq), float("nan"), dtype=torch.float32, device=device)
    kw = dict(softmax_scale=scale, causal=False, q_start=0, k_start=0, softcap=softcap)
    attention_forward(q, ks[0], vs[0], out_acc=out_acc, lse_acc=lse_acc, fresh=True, **kw)
    attention_forward(q, ks[1], vs[1], out_acc=out_acc, lse_acc=lse_acc, **kw)
    out = out_acc.to(dtype)
    delta = attention_delta(dout, out)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
    dk, dvv = torch.zeros(k.shape, dtype=torch.float32, device=device), torch.zeros(v.shape, dtype=torch.float32,
                                                                                        device=device)
    for lo, hi in ((0, sk1), (sk1, sk1 + sk2)):
        attention_backward(dout, q, k[:, lo:hi], v[:, lo:hi], out, lse_acc, delta, **kw, dq_acc=dq,
                           dk_acc=dk[:, lo:hi], dv_acc=dvv[:, lo:hi])
    ref = oracle(q, k, v, dout, scale=scale, softcap=softcap, mask=None)
    base = oracle(q, k, v, dout, scale=scale, softcap=softcap, mask=None, dtype=dtype) \
        if dtype != torch.float32 else [None] * 5
    # the merged state is float32: judge it as the 16-bit output would be
    _judge([out_acc, lse_acc, dq, dk, dvv], ref, base, dtype)


def test_softcap_zero_is_bit_identical(device):
    """softcap=0 compiles the cap out: the same results, bit for bit, as a call without it."""
    q, k, v, dout = _draw(1, 50, 37, 2, 1, 64, 64, torch.float32, device)
    a = attention_forward(q, k, v, softmax_scale=0.125, causal=True, q_start=10, k_start=0)
    b = attention_forward(q, k, v, softmax_scale=0.125, causal=True, q_start=10, k_start=0, softcap=0.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bad_arguments(device):
    q, k, v, dout = _draw(1, 8, 8, 2, 1, 64, 32, torch.float32, device)
    with pytest.raises(ValueError, match="softcap"):
        attention_forward(q, k, v, softmax_scale=0.1, causal=False, q_start=0, k_start=0, softcap=-1.0)
    out, lse = attention_forward(q, k, v, softmax_scale=0.1, causal=False, q_start=0, k_start=0)
    assert out.shape == (1, 8, 2, 32)
    with pytest.raises(ValueError, match="dout"):
        attention_backward(q, q, k, v, out, lse, lse, softmax_scale=0.1, causal=False, q_start=0, k_start=0,
                           dq_acc=None, dk_acc=None, dv_acc=None)
    with pytest.raises(ValueError, match="out_acc"):
        attention_forward(q, k, v, softmax_scale=0.1, causal=False, q_start=0, k_start=0,
                          out_acc=torch.zeros(q.shape), lse_acc=torch.zeros(1, 2, 8))


# ---------------------------------------------------------------------------------------------------
# GPU: bf16, larger blocks, the Gluon kernels on sm_90


GPU_CASES = [
    ((128, 128), 30.0, "none"),
    ((128, 128), 30.0, "causal"),
    ((64, 64), 5.0, "intervals"),
    ((192, 128), 0.0, "none"),
    ((192, 128), 0.0, "causal"),
    ((192, 128), 30.0, "intervals"),
    ((128, 64), 30.0, "causal"),
    # a cap whose fixed shift lies below it (scores up to 2**19 over the shift) and a small one
    ((128, 128), 50.0, "causal"),
    ((128, 128), 1.0, "intervals"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dims,softcap,mask_kind", GPU_CASES)
def test_gpu_bf16_block(dims, softcap, mask_kind):
    check_block(torch.bfloat16, "cuda", d=dims[0], dv=dims[1], softcap=softcap, mask_kind=mask_kind, sq=1000,
                sk=1031, h=4, hkv=2)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["causal", "intervals"])
def test_gpu_fp16_block(mask_kind):
    """fp16 keeps the running max with a softcap (its P would flush weights far below a fixed shift)."""
    check_block(torch.float16, "cuda", d=128, dv=128, softcap=30.0, mask_kind=mask_kind, sq=1000, sk=1031, h=4,
                hkv=2)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [30.0, 50.0], ids=["cap30", "cap50"])
def test_gpu_bf16_scores_at_the_floor(softcap):
    """Every score of most rows pressed against -softcap (queries positive, keys negative, a large scale),
    the rest spread: the capped forward's fixed shift must keep these weights, its smallest, exact."""
    q, k, v, dout = _draw(1, 300, 517, 4, 2, 128, 128, torch.bfloat16, "cuda", seed=5)
    q = q.abs()
    k = -k.abs()
    k[:, ::7] = -k[:, ::7]
    scale = 0.5
    ours = run_block(q, k, v, dout, scale=scale, softcap=softcap)
    ref = oracle(q, k, v, dout, scale=scale, softcap=softcap, mask=None)
    base = oracle(q, k, v, dout, scale=scale, softcap=softcap, mask=None, dtype=torch.bfloat16)
    _judge(ours, ref, base, torch.bfloat16)
    q[:, 100:] = q[:, 100:] * 0 + 1
    k = -k.abs()
    ours = run_block(q, k, v, dout, scale=scale, softcap=softcap)
    ref = oracle(q, k, v, dout, scale=scale, softcap=softcap, mask=None)
    base = oracle(q, k, v, dout, scale=scale, softcap=softcap, mask=None, dtype=torch.bfloat16)
    _judge(ours, ref, base, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dims,softcap", [((128, 128), 30.0), ((192, 128), 0.0), ((192, 128), 5.0)])
def test_gpu_bf16_merge(dims, softcap):
    test_merge_two_blocks(dims, softcap, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_gpu_gluon_kernels_take_these_cases():
    """On sm_90 the bf16 cases above run the Gluon kernels (so those tests judge them): the forward with a
    softcap and with Q/K 192 / V 128, the dk/dv kernel with a softcap; V's own head dim in the backward
    stays with the portable kernels."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are built for sm_90")
    from ringlse.kernels.attention_bwd_hopper import hopper_dkdv_applies
    from ringlse.kernels.attention_fwd_hopper import hopper_forward_applies

    q = torch.empty(1, 128, 4, 128, device="cuda", dtype=torch.bfloat16)
    q192 = torch.empty(1, 128, 4, 192, device="cuda", dtype=torch.bfloat16)
    q64 = torch.empty(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
    assert hopper_forward_applies(q, q, q, softcap=30.0)
    assert hopper_forward_applies(q192, q192, q) and hopper_forward_applies(q192, q192, q, softcap=30.0)
    assert hopper_forward_applies(q, q, q64, softcap=30.0)
    assert hopper_dkdv_applies(q, q, q, q, softcap=30.0) and hopper_dkdv_applies(q64, q64, q64, q64, softcap=5.0)
    assert not hopper_dkdv_applies(q192, q192, q, q) and not hopper_dkdv_applies(q, q, q64, q64)
