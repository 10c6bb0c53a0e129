"""The Gluon Hopper kernels (`ringlse.kernels.attention_fwd_hopper`, `attention_bwd_hopper`) on an sm_90 GPU,
judged by CONVENTIONS.md §7 against the float64 reference, next to the Triton kernels they replace there.

`attention_forward` routes bf16/fp16 head dims 64/128 to it on sm_90, so the GPU tests of
test_triton_attention.py run it too; these add every table config, strided and GQA inputs, the
in-kernel merge, the persistent walk's ring across work tiles, and the fallback for strides TMA cannot
index. Gluon has no CPU interpreter: without an sm_90 GPU these skip.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
hopper = pytest.importorskip("ringlse.kernels.attention_fwd_hopper")

from ringlse import reference_attention, update_out_and_lse  # noqa: E402
from ringlse.kernels import attention_fwd as fwd_mod  # noqa: E402
from ringlse.kernels.attention_common import fwd_configs, mask_offset  # noqa: E402
from ringlse.testing import assert_judged, naive_attention  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 GPU"),
]


def _draw(b, sq, sk, h, hkv, d, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=g).to(device="cuda", dtype=dtype)
                 for s, n in ((sq, h), (sk, hkv), (sk, hkv)))


def _run(q, k, v, causal, q_start, k_start, config=None, tl=False, state=None):
    """Our forward into poisoned buffers (or merged into `state`): the Hopper kernel with `config`, or the
    Triton kernel with its first config when `tl`."""
    b, sq, h, d = q.shape
    if state is None:
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
    else:
        out, lse = state[0].clone(), state[1].clone()
    kw = dict(softmax_scale=d**-0.5, causal=causal, offset=mask_offset(causal, sq, k.shape[1], q_start, k_start),
              accum=state is not None)
    if tl:
        fwd_mod._forward_impl(q, k, v, out, lse, config=fwd_configs(d, q.dtype, causal)[0], **kw)
    else:
        assert hopper.hopper_forward_applies(q, k, v)
        hopper.hopper_forward(q, k, v, out, lse, config=config, **kw)
    return out, lse


def _judge(q, k, v, causal, q_start, k_start, out, lse, state=None):
    ref_o, ref_l = reference_attention(q.double(), k.double(), v.double(), causal=causal, q_start=q_start,
                                       k_start=k_start)
    base_o, base_l = naive_attention(q, k, v, causal=causal, q_start=q_start, k_start=k_start)
    if state is not None:
        ref_o, ref_l = update_out_and_lse(state[0].double(), state[1].double(), ref_o, ref_l)
        base_o, base_l = update_out_and_lse(state[0], state[1], base_o, base_l.float())
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was not written"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l)), "rows that see no key must have lse -inf"
    if state is None:
        assert (out[torch.isneginf(lse).transpose(1, 2)] == 0).all(), "rows that see no key must have out 0"
    assert_judged("out", out, ref_o, base_o, q.dtype)
    assert_judged("lse", lse, ref_l, base_l, q.dtype, is_lse=True)


# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim), causal, (q_start, k_start)
CASES = [
    pytest.param((2, 97, 333, 4, 2, 64), True, (236, 0), id="97x333x4of2x64-causal-offset"),
    pytest.param((1, 1025, 1025, 8, 2, 128), True, (0, 0), id="1025x8of2x128-causal"),
    pytest.param((2, 300, 1025, 4, 4, 128), False, (0, 0), id="300x1025x4x128-full"),
    pytest.param((1, 640, 256, 2, 1, 64), True, (-130, 0), id="640x256x2of1x64-rows-see-nothing"),
    pytest.param((1, 3000, 2500, 16, 16, 64), False, (0, 0), id="3000x2500x16x64-many-work-tiles"),
    # O leaves through TMA over the batch seen as [b * s] rows: a last tile past an element's end (192 rows
    # in 128-row tiles, 128 in 192-row ones) must not land on the next element's first rows
    pytest.param((2, 192, 256, 4, 2, 128), False, (0, 0), id="2x192x256x4of2x128-full-o-tile-past-the-end"),
    pytest.param((3, 128, 128, 2, 2, 64), True, (0, 0), id="3x128x2x64-causal-o-tile-past-the-end"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape,causal,offsets", CASES)
def test_table_config(shape, causal, offsets, dtype):
    b, sq, sk, h, hkv, d = shape
    q, k, v = _draw(b, sq, sk, h, hkv, d, dtype, seed=sq)
    out, lse = _run(q, k, v, causal, *offsets)
    _judge(q, k, v, causal, *offsets, out, lse)
    # the public launcher takes this kernel, bit for bit
    o2, l2 = fwd_mod.attention_forward(q, k, v, softmax_scale=d**-0.5, causal=causal, q_start=offsets[0],
                                       k_start=offsets[1])
    assert torch.equal(o2, out) and torch.equal(l2, lse)


@pytest.mark.parametrize("config", [hopper.HopperConfig(128, True), hopper.HopperConfig(128, False),
                                    hopper.HopperConfig(192, True), hopper.HopperConfig(192, False)],
                         ids=["m128-persistent", "m128", "m192-persistent", "m192"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_config_d64(config, causal):
    # more work tiles than SMs, so persistent programs carry the K/V ring and Q across tiles
    q, k, v = _draw(2, 2100, 2100, 40, 8, 64, torch.bfloat16, seed=5)
    out, lse = _run(q, k, v, causal, 0, 0, config=config)
    _judge(q, k, v, causal, 0, 0, out, lse)


@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("causal,offsets", [(True, (0, 200)), (False, (0, 0)), (True, (0, 5000))],
                         ids=["masked-rows", "full", "fully-masked"])
def test_merge_into_state(d, causal, offsets):
    q, k, v = _draw(2, 1000, 1300, 8, 4, d, torch.bfloat16, seed=24)
    g = torch.Generator(device="cpu").manual_seed(7)
    state_o = torch.randn(q.shape, generator=g).cuda()
    state_l = (torch.randn(2, 8, 1000, generator=g) * 3).cuda()
    state_l[:, :, ::3] = float("-inf")  # rows that have seen nothing yet
    state_o[:, ::3] = float("nan")  # ... whose out must be ignored (weight 0)
    out, lse = _run(q, k, v, causal, *offsets, state=(state_o, state_l))
    _judge(q, k, v, causal, *offsets, out, lse, state=(torch.where(state_o.isnan(), 0.0, state_o), state_l))


def _random_state(shape, lse_shape, seed):
    """A running state with rows that have seen nothing yet (lse -inf, out NaN: weight 0, ignored)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    state_o = torch.randn(shape, generator=g).cuda()
    state_l = (torch.randn(lse_shape, generator=g) * 3).cuda()
    state_l[:, :, ::3] = float("-inf")
    state_o[:, ::3] = float("nan")
    return state_o, state_l


@pytest.mark.parametrize("config", [hopper.HopperConfig(128, True), hopper.HopperConfig(128, False)],
                         ids=["m128-persistent", "m128"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_merge_every_config(config, d, causal):
    """The merging forward's state goes by TMA through shared memory (128-row tiles); persistent programs
    (more work tiles than SMs) reuse the buffer tile after tile, its store draining while the next tile
    runs: every tile's state must be read before it is overwritten and written back whole."""
    q, k, v = _draw(1, 2100, 2100, 24, 8, d, torch.bfloat16, seed=61 + d)
    state = _random_state(q.shape, (1, 24, 2100), seed=8)
    out, lse = _run(q, k, v, causal, 0, 0, config=config, state=state)
    _judge(q, k, v, causal, 0, 0, out, lse, state=(torch.where(state[0].isnan(), 0.0, state[0]), state[1]))


@pytest.mark.parametrize("kind", ["window", "documents", "random"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_interval_masks_merge(kind, d):
    """Interval masks merging into a running state (the ring's windows and documents), rows that see no
    key of this block keeping their state."""
    q, k, v = _draw(2, 1500, 1300, 4, 2, d, torch.bfloat16, seed=33)
    lo, hi = _intervals(1500, 1300, kind, seed=d)
    scale = d**-0.5
    state_o, state_l = _random_state(q.shape, (2, 4, 1500), seed=9)
    out, lse = state_o.clone(), state_l.clone()
    hopper.hopper_forward(q, k, v, out, lse, softmax_scale=scale, causal=False, offset=0, accum=True,
                          key_lo=lo, key_hi=hi)
    state_o = torch.where(state_o.isnan(), 0.0, state_o)
    ref_o, ref_l = update_out_and_lse(state_o.double(), state_l.double(),
                                      *_masked_attention(q, k, v, scale, lo, hi, torch.float64))
    blk_o, blk_l = _masked_attention(q, k, v, scale, lo, hi, torch.bfloat16)
    base_o, base_l = update_out_and_lse(state_o, state_l, blk_o, blk_l.float())
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was not written"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l)), "rows that saw nothing must keep lse -inf"
    assert_judged("out", out, ref_o, base_o, torch.bfloat16)
    assert_judged("lse", lse, ref_l, base_l, torch.bfloat16, is_lse=True)


@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("mask", ["causal", "full", "documents"])
def test_fresh_state_is_the_plain_forward(d, mask):
    """`fresh=True` (a row range's first block, `StateRows`): poisoned float32 accumulators written, never
    read, bit for bit the plain forward's state; batch of 2 with partial tiles (one launch per element)."""
    from ringlse.kernels.attention_fwd import attention_forward

    q, k, v = _draw(2, 1000, 1300, 8, 4, d, torch.bfloat16, seed=25)
    kw = dict(softmax_scale=d**-0.5, causal=mask == "causal", q_start=300, k_start=0)
    if mask == "documents":
        lo, hi = _intervals(1000, 1300, "documents", seed=3)
        kw.update(causal=False, key_lo=lo, key_hi=hi)
    assert hopper.hopper_forward_applies(q, k, v)
    out, lse = attention_forward(q, k, v, **kw)
    acc = torch.full(q.shape, float("nan"), device="cuda"), torch.full((2, 8, 1000), float("nan"), device="cuda")
    attention_forward(q, k, v, **kw, out_acc=acc[0], lse_acc=acc[1], fresh=True)
    assert torch.equal(acc[0].to(q.dtype), out) and torch.equal(acc[1], lse)
    assert not acc[0].isnan().any()


@pytest.mark.parametrize("ramp", ["slow-climb", "jumps", "falling"])
@pytest.mark.parametrize("d,config", [(128, None), (64, hopper.HopperConfig(128, True)),
                                      (64, hopper.HopperConfig(128, False))],
                         ids=["d128-table", "d64-m128-persistent", "d64-m128"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lazy_maxima(ramp, d, config, causal):
    # 128-row tiles keep a row's max until a key tile's exceeds it by more than 8 (base 2): scores that
    # climb by less than that per key tile (the max goes stale for a few tiles, then moves), that jump by
    # far more within a tile, or that fall after the first tile (the max never moves)
    q, k, v = _draw(1, 1500, 1500, 4, 2, d, torch.float16, seed=31)
    pos = torch.arange(1500, device="cuda", dtype=torch.float32)
    score = {"slow-climb": 60 * pos / 1500, "jumps": 25 * (pos // 300), "falling": -60 * pos / 1500}[ramp]
    q = q * 0.05
    q[..., 0] = 1.0
    k = k * 0.05
    # q.k * scale = score (natural-log units; x 1.44 in base 2) plus noise
    k[..., 0] = (score / d**-0.5)[None, :, None].to(k.dtype)
    out, lse = _run(q, k, v, causal, 0, 0, config=config)
    _judge(q, k, v, causal, 0, 0, out, lse)


def test_same_error_as_the_triton_kernel():
    # both kernels judged on one input: the Hopper one within the bound the Triton one meets
    q, k, v = _draw(1, 4096, 4096, 8, 2, 128, torch.bfloat16, seed=22)
    for tl in (False, True):
        out, lse = _run(q, k, v, True, 0, 0, tl=tl)
        _judge(q, k, v, True, 0, 0, out, lse)


def test_packed_qkv_strides():
    # q, k, v as views of one [b, s, 3, h, d] buffer: rows of 3*h*d elements, which TMA indexes directly
    qkv = torch.randn(2, 777, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert hopper.hopper_forward_applies(q, k, v)
    out, lse = _run(q, k, v, True, 0, 0)
    _judge(q, k, v, True, 0, 0, out, lse)


def test_strides_tma_cannot_index_fall_back():
    # keys cut from a longer sequence in a batch of 2: the batch stride is no multiple of the row stride
    q, k_long, v_long = _draw(2, 300, 500, 4, 4, 64, torch.bfloat16, seed=3)
    k, v = k_long[:, :333], v_long[:, :333]
    assert not hopper.hopper_forward_applies(q, k, v)
    out, lse = fwd_mod.attention_forward(q, k, v, softmax_scale=0.125, causal=False, q_start=0, k_start=0)
    _judge(q, k, v, False, 0, 0, out, lse)


def test_applies_only_where_built_for():
    q = torch.empty(1, 128, 4, 128, device="cuda", dtype=torch.bfloat16)
    assert hopper.hopper_forward_applies(q, q, q)
    assert not hopper.hopper_forward_applies(q.float(), q.float(), q.float())
    r = torch.empty(1, 128, 4, 96, device="cuda", dtype=torch.bfloat16)
    assert not hopper.hopper_forward_applies(r, r, r)


# ---------------------------------------------------------------------------------------------------
# backward: the Gluon dk/dv kernel (dq stays the Triton kernel's)

bwd_hopper = pytest.importorskip("ringlse.kernels.attention_bwd_hopper")


def _grads(fn, q, k, v, go, acc_dtype):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, _ = fn(q, k, v)
    (o.to(acc_dtype) * go.to(acc_dtype)).sum().backward()
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("shape,causal,offsets", CASES)
def test_backward_gradients(shape, causal, offsets):
    import ringlse

    b, sq, sk, h, hkv, d = shape
    q, k, v = _draw(b, sq, sk, h, hkv, d, torch.bfloat16, seed=sq + 1)
    assert bwd_hopper.hopper_dkdv_applies(q, k, v, q)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    kw = dict(causal=causal, q_start=offsets[0], k_start=offsets[1])
    ours = _grads(lambda a, b_, c: ringlse.block_attention(a, b_, c, backend="triton", **kw), q, k, v, go,
                  torch.float32)
    ref = _grads(lambda a, b_, c: reference_attention(a, b_, c, **kw), q.double(), k.double(), v.double(), go,
                 torch.float64)
    base = _grads(lambda a, b_, c: naive_attention(a, b_, c, **kw), q, k, v, go, torch.bfloat16)
    for name, o, r, bl in zip(("dq", "dk", "dv"), ours, ref, base):
        assert not torch.isnan(o).any(), f"{name} has NaN"
        assert_judged(name, o, r, bl, torch.bfloat16)


@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_batch_elements_never_reach_each_other(d, causal):
    """The kernels' descriptors see a batch as one `[b * s]` matrix: with 1000 queries and keys (partial
    last tiles) a tile of element 0 would read element 1's first rows. NaN in every input of element 1
    must leave element 0's out, lse and gradients exactly what element 0 alone gives."""
    import ringlse

    q, k, v = _draw(2, 1000, 1000, 4, 2, d, torch.bfloat16, seed=40 + d)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    for t in (q, k, v, go):
        t[1] = float("nan")

    def run(*tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors[:3]]
        out, lse = ringlse.block_attention(*leaves, causal=causal, backend="triton")
        ((out.float() * tensors[3].float()).sum() + lse.sum()).backward()
        return [out, lse, *(t.grad for t in leaves)]

    batched = run(q, k, v, go)
    alone = run(*(t[:1] for t in (q, k, v, go)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), batched, alone):
        assert a[:1].isfinite().all(), f"{name}: element 1's NaN reached element 0"
        assert torch.equal(a[:1], b), f"{name}: element 0 differs from element 0 alone"


@pytest.mark.parametrize("shape,causal,offsets", [
    pytest.param((1, 2048, 2048, 8, 2, 128), True, (0, 0), id="2048x8of2x128-causal"),
    pytest.param((1, 1500, 2100, 4, 4, 64), False, (0, 0), id="1500x2100x4x64-full"),
    pytest.param((2, 1000, 1000, 4, 1, 128), True, (300, 0), id="2x1000x4of1x128-causal-offset"),
    # query i sees keys j <= i - 300: the key tiles from 640 on see no query and take no step
    pytest.param((1, 777, 1500, 8, 8, 128), True, (0, 300), id="777x1500x8x128-causal-unseen-keys"),
    pytest.param((1, 777, 1500, 8, 2, 64), True, (0, 300), id="777x1500x8of2x64-causal-unseen-keys"),
])
def test_fused_dq_is_the_same_bit_for_bit(shape, causal, offsets):
    """On dense blocks dq is added inside the dk/dv kernel, each query tile taking its key tiles' TMA adds in a
    fixed order: three backward passes from zero give the same dq (and dk, dv) bits, and dq agrees with the
    Triton dq kernel's within the tolerance of §7 (both judged against the float64 reference elsewhere)."""
    from ringlse.kernels.attention_bwd import attention_backward, attention_delta

    b, sq, sk, h, hkv, d = shape
    q, k, v = _draw(b, sq, sk, h, hkv, d, torch.bfloat16, seed=sq + d)
    do = torch.randn_like(q)
    kw = dict(softmax_scale=d**-0.5, causal=causal, q_start=offsets[0], k_start=offsets[1])
    out, lse = fwd_mod.attention_forward(q, k, v, **kw)
    delta = attention_delta(do, out)
    assert bwd_hopper.hopper_fuses_dq(torch.zeros(q.shape, device="cuda"), *(torch.zeros(k.shape, device="cuda"),) * 2)
    runs = []
    for _ in range(3):
        dq, dk, dv = (torch.zeros(t.shape, device="cuda") for t in (q, k, v))
        attention_backward(do, q, k, v, out, lse, delta, dq_acc=dq, dk_acc=dk, dv_acc=dv, **kw)
        runs.append((dq, dk, dv))
    for other in runs[1:]:
        for name, x, y in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(x, y), f"{name} differs between two runs"
    # dq alone (no dk/dv accumulators): the Triton dq kernel
    dq_split = torch.zeros(q.shape, device="cuda")
    attention_backward(do, q, k, v, out, lse, delta, dq_acc=dq_split, dk_acc=None, dv_acc=None, **kw)
    ref = _grads(lambda a, b_, c: reference_attention(a, b_, c, **kw), q.double(), k.double(), v.double(), do,
                 torch.float64)[0]
    base = _grads(lambda a, b_, c: naive_attention(a, b_, c, **kw), q, k, v, do, torch.bfloat16)[0]
    assert_judged("dq fused", runs[0][0], ref, base, torch.bfloat16)
    assert_judged("dq split", dq_split, ref, base, torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dkdv_adds_into_views(causal):
    # dk/dv accumulators: views of larger NaN-poisoned buffers holding earlier gradients
    from ringlse.kernels.attention_bwd import attention_backward, attention_delta

    q, k, v = _draw(2, 700, 1111, 8, 2, 128, torch.bfloat16, seed=25)
    do = torch.randn_like(q)
    out, lse = fwd_mod.attention_forward(q, k, v, softmax_scale=0.1, causal=causal, q_start=500, k_start=0)
    delta = attention_delta(do, out)
    grads = []
    for start in (None, 3.0):
        buf = torch.full((2, 1111 + 4, 2, 128), float("nan"), device="cuda")
        bufk, bufv = buf.clone(), buf.clone()
        dk, dv = bufk[:, 4:], bufv[:, 4:]
        dk.fill_(0.0 if start is None else start)
        dv.fill_(0.0 if start is None else start)
        dq = torch.zeros(q.shape, device="cuda")
        attention_backward(do, q, k, v, out, lse, delta, softmax_scale=0.1, causal=causal, q_start=500, k_start=0,
                           dq_acc=dq, dk_acc=dk, dv_acc=dv)
        assert torch.isnan(bufk[:, :4]).all() and torch.isnan(bufv[:, :4]).all(), "wrote outside the view"
        grads.append((dk.clone(), dv.clone()))
    # adding into 3.0 gives 3.0 + the gradient added into 0.0
    for g0, g3 in zip(*grads):
        torch.testing.assert_close(g3 - 3.0, g0, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# forward under interval masks (windows, packed documents): query i sees the keys [lo[i], hi[i])


def _masked_attention(q, k, v, scale, lo, hi, dtype):
    """Attention under the dense mask `lo[i] <= j < hi[i]` with every operation in `dtype` (float64: the
    reference; the input dtype: the baseline of CONVENTIONS.md §7); rows that see nothing: 0, -inf."""
    h, hkv = q.shape[2], k.shape[2]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    j = torch.arange(k.shape[1], device=q.device)
    mask = (j[None, :] >= lo[:, None].long()) & (j[None, :] < hi[:, None].long())
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(h // hkv, 2)) * scale
    # rows that see no key compute on zeros (no -inf - -inf, no NaN gradient) and are zeroed by the mask
    sees = mask.any(-1)
    s = s.masked_fill(~mask, float("-inf")).masked_fill(~sees[:, None], 0.0)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]) * mask
    out = torch.einsum("bhij,bjhd->bihd", p, v.repeat_interleave(h // hkv, 2))
    return out, lse.masked_fill(~sees, float("-inf"))


def _intervals(sq, sk, kind, seed):
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(sq)
    if kind == "window":  # causal sliding window of 300 keys, diagonal at key i + 40
        hi = (i + 41).clamp(max=sk)
        lo = (hi - 300).clamp(min=0)
    elif kind == "documents":  # causal within documents of random lengths (one empty), some rows past the keys
        cuts = sorted(torch.randint(1, sk, (6,), generator=g).tolist()) + [sk, sk]
        starts = torch.tensor([0] + cuts[:-1])
        doc = torch.searchsorted(torch.tensor(cuts), i, right=True).clamp(max=len(cuts) - 1)
        lo = starts[doc]
        hi = torch.minimum(i + 1, torch.tensor(cuts)[doc])
    elif kind == "swapped":  # two documents whose keys come in the other order: bounds that decrease
        a, ka = sq // 3, sk // 2 + 7
        lo = torch.where(i < a, sk - ka, 0)
        hi = torch.where(i < a, sk, sk - ka)
    else:  # any bounds: not monotone, empty rows and gaps between rows
        lo = torch.randint(0, sk, (sq,), generator=g)
        hi = lo + torch.randint(-50, 400, (sq,), generator=g)
    return lo.to(torch.int32).cuda(), hi.clamp(min=0).to(torch.int32).cuda()


@pytest.mark.parametrize("kind", ["window", "documents", "random"])
@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (128, torch.bfloat16), (128, torch.float16)],
                         ids=["d64-bf16", "d128-bf16", "d128-fp16"])
def test_interval_masks(kind, d, dtype):
    q, k, v = _draw(2, 1500, 1300, 4, 2, d, dtype, seed=31)
    lo, hi = _intervals(1500, 1300, kind, seed=d)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, 1500), float("nan"), dtype=torch.float32, device="cuda")
    hopper.hopper_forward(q, k, v, out, lse, softmax_scale=scale, causal=False, offset=0, accum=False,
                          key_lo=lo, key_hi=hi)
    ref_o, ref_l = _masked_attention(q, k, v, scale, lo, hi, torch.float64)
    base_o, base_l = _masked_attention(q, k, v, scale, lo, hi, dtype)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output element was not written"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l)), "rows that see no key must have lse -inf"
    assert (out[torch.isneginf(lse).transpose(1, 2)] == 0).all()
    assert_judged("out", out, ref_o, base_o, dtype)
    assert_judged("lse", lse, ref_l, base_l, dtype, is_lse=True)
    # the public launcher takes this kernel, bit for bit
    o2, l2 = fwd_mod.attention_forward(q, k, v, softmax_scale=scale, causal=False, q_start=0, k_start=0,
                                       key_lo=lo, key_hi=hi)
    assert torch.equal(o2, out) and torch.equal(l2, lse)


def _inverse(lo, hi, sq, sk):
    """Per key, the queries that see it as one interval `[query_lo, query_hi)` (checked to be one)."""
    i = torch.arange(sq, device=lo.device)
    j = torch.arange(sk, device=lo.device)
    mask = (j[None, :] >= lo[:, None].long()) & (j[None, :] < hi[:, None].long())
    seen = mask.any(0)
    first = torch.where(seen, mask.int().argmax(0), 0)
    last = torch.where(seen, sq - mask.flip(0).int().argmax(0), 0)
    inside = (i[:, None] >= first[None, :]) & (i[:, None] < last[None, :])
    assert torch.equal(inside, mask), "the mask is not one interval of queries per key"
    return first.to(torch.int32), last.to(torch.int32)


@pytest.mark.parametrize("kind", ["window", "documents", "swapped"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_interval_masks_backward(kind, d):
    """The Gluon forward's lse and out feed the backward (the Gluon kernel adding dq, dk and dv in one pass
    under intervals). Windows and documents (bounds that never decrease) give the same bits in two runs;
    "swapped" documents (keys in the other order) do not promise that, only the right sum, and no hang."""
    from ringlse.kernels.attention_bwd import attention_backward, attention_delta

    q, k, v = _draw(2, 1500, 1300, 4, 2, d, torch.bfloat16, seed=41)
    lo, hi = _intervals(1500, 1300, kind, seed=d)
    qlo, qhi = _inverse(lo, hi, 1500, 1300)
    scale = d**-0.5
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    out, lse = fwd_mod.attention_forward(q, k, v, softmax_scale=scale, causal=False, q_start=0, k_start=0,
                                         key_lo=lo, key_hi=hi)
    runs = []
    for _ in range(2):
        grads = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
        attention_backward(do, q, k, v, out, lse, attention_delta(do, out), softmax_scale=scale, causal=False,
                           q_start=0, k_start=0, dq_acc=grads[0], dk_acc=grads[1], dv_acc=grads[2], key_lo=lo,
                           key_hi=hi, query_lo=qlo, query_hi=qhi)
        runs.append(grads)
    if kind != "swapped":
        for name, x, y in zip(("dq", "dk", "dv"), *runs):
            assert torch.equal(x, y), f"{name} differs between two runs"

    def autograd(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, _ = _masked_attention(*leaves, scale, lo, hi, dtype)
        (o * do.to(dtype)).sum().backward()
        return [t.grad for t in leaves]

    for name, ours, ref, base in zip(("dq", "dk", "dv"), runs[0], autograd(torch.float64), autograd(torch.bfloat16)):
        assert not torch.isnan(ours).any(), f"{name} has NaN"
        assert_judged(name, ours, ref, base, torch.bfloat16)
