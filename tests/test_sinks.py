"""Learnable attention sinks (CONVENTIONS.md §3): one logit per query head joins every row's softmax
denominator exactly once, on every entry point, backend and ring, forward and backward (d sinks
included), against the dense float64 oracle written from the definition (`mask_oracle.oracle` with
`sinks`: one more score column per row, as GPT-OSS's eager attention)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ringlse
from dist_harness import run_ranks
from mask_oracle import oracle
from ringlse.blocks.sdpa import SDPA_BLOCK_OP

F64 = torch.float64


def sink_oracle(q, k, v, q_pos, k_pos, causal, window, docs, sinks):
    return oracle(q, k, v, q_pos, k_pos, causal, window, docs, sinks=sinks)


def _inputs(b, sq, sk, h, hkv, d, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(*shape, generator=g, dtype=F64) for shape in
         ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d), (b, h, sq), (h,))]
    return [x.to(dtype) for x in t[:3]] + t[3:]


def _grads(fn, q, k, v, sinks, dout, dlse):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = fn(*leaves)
    ((out.double() * dout).sum() + (lse.double() * dlse).sum()).backward()
    return [out.detach(), lse.detach(), *(t.grad for t in leaves)]


def _check(ours, ref, **tol):
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), ours, ref):
        torch.testing.assert_close(a.double(), r.double(), msg=lambda m: f"{name}: {m}", **tol)


MASKS = [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, window_size=(2, 0)), id="window"),
    pytest.param(dict(causal=False, cu_seqlens=[0, 4, 4, 13]), id="documents"),
    pytest.param(dict(causal=True, window_size=(3, 1), cu_seqlens=[0, 1, 9, 13]), id="window-documents"),
]


def _mask(kw):
    return kw.get("causal", False), kw.get("window_size", (-1, -1)), kw.get("cu_seqlens")


@pytest.mark.parametrize("kw", MASKS)
@pytest.mark.parametrize("fn", ["attention", "chunked_attention"])
def test_single_device_entry_points_match_the_oracle(fn, kw):
    q, k, v, dout, dlse, sinks = _inputs(2, 13, 13, 4, 2, 8, seed=1)
    extra = dict(chunk_size=5) if fn == "chunked_attention" else {}
    ours = _grads(lambda *t: getattr(ringlse, fn)(*t[:3], sinks=t[3], return_lse=True, backend="torch", **kw, **extra),
                  q, k, v, sinks, dout, dlse)
    ref = _grads(lambda *t: sink_oracle(*t[:3], range(13), range(13), *_mask(kw), t[3]), q, k, v, sinks, dout, dlse)
    _check(ours, ref)


@pytest.mark.parametrize("block", [pytest.param((15, 6, 0, 10), id="sees-keys"),
                                   pytest.param((0, 5, 9, 4), id="sees-only-the-sink")])
def test_block_at_offsets_matches_the_oracle(block):
    """Rows that see no key see the sink alone: out 0, lse = sink, gradient to the sink only."""
    q_start, sq, k_start, sk = block
    q, k, v, dout, dlse, sinks = _inputs(1, sq, sk, 4, 4, 8, seed=2)
    kw = dict(causal=True, cu_seqlens=[0, 3, 30])
    ours = _grads(lambda *t: ringlse.block_attention(*t[:3], sinks=t[3], q_start=q_start, k_start=k_start,
                                                     backend="torch", **kw), q, k, v, sinks, dout, dlse)
    ref = _grads(lambda *t: sink_oracle(*t[:3], range(q_start, q_start + sq), range(k_start, k_start + sk),
                                        True, (-1, -1), kw["cu_seqlens"], t[3]), q, k, v, sinks, dout, dlse)
    _check(ours, ref)
    if block[0] < block[2]:
        assert torch.equal(ours[1], sinks.expand(1, sq, 4).transpose(1, 2)) and not ours[0].any()


def test_varlen_matches_the_oracle():
    q, k, v, dout, dlse, sinks = _inputs(1, 12, 12, 2, 1, 8, seed=3)
    bounds = [0, 5, 12]

    def ours_fn(q_, k_, v_, s_):
        out, lse = ringlse.varlen_attention(q_[0], k_[0], v_[0], bounds, bounds, causal=True, sinks=s_,
                                            return_lse=True)
        return out[None], lse[None]

    ours = _grads(ours_fn, q, k, v, sinks, dout, dlse)
    ref = _grads(lambda *t: sink_oracle(*t[:3], range(12), range(12), True, (-1, -1), bounds, t[3]),
                 q, k, v, sinks, dout, dlse)
    _check(ours, ref)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_other_backends_take_sinks(backend):
    """The sink is merged after the blocks, whatever computed them: the Triton kernels (interpreter,
    float32) and the CPU `sdpa` op (float32), within CONVENTIONS.md §7's float32 bound."""
    op = SDPA_BLOCK_OP if backend == "sdpa" else "triton"
    q, k, v, dout, dlse, sinks = _inputs(1, 17, 17, 2, 1, 16, seed=4, dtype=torch.float32)
    ours = _grads(lambda *t: ringlse.attention(*t[:3], causal=True, sinks=t[3], return_lse=True, backend=op),
                  q, k, v, sinks.float(), dout, dlse)
    ref = _grads(lambda *t: sink_oracle(*t[:3], range(17), range(17), True, (-1, -1), None, t[3]),
                 q.double(), k.double(), v.double(), sinks, dout, dlse)
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), ours, ref):
        assert (a.double() - r).abs().max() <= 1e-3 * r.abs().max(), name


def test_a_sink_state_merged_by_merge_attn_states_is_the_same():
    """A sink is a state with output 0 and lse = sink: merged by `merge_attn_states`, gradients reach it."""
    q, k, v, dout, dlse, sinks = _inputs(1, 9, 9, 2, 2, 8, seed=5)

    def merged(q_, k_, v_, s_):
        out, lse = ringlse.attention(q_, k_, v_, causal=True, return_lse=True)
        return ringlse.merge_attn_states([out, torch.zeros_like(out)], [lse, s_[None, :, None].expand_as(lse)])

    ours = _grads(merged, q, k, v, sinks, dout, dlse)
    ref = _grads(lambda *t: ringlse.attention(*t[:3], causal=True, sinks=t[3], return_lse=True), q, k, v, sinks,
                 dout, dlse)
    _check(ours, ref)


def test_minus_infinite_sinks_change_nothing_and_empty_rows_stay_empty():
    q, k, v, *_ = _inputs(1, 4, 4, 2, 2, 8, seed=6)
    s = torch.full((2,), float("-inf"), dtype=F64)
    out, lse = ringlse.block_attention(q, k, v, causal=True, q_start=0, k_start=8, sinks=s)
    assert not out.any() and torch.isneginf(lse).all()
    plain = ringlse.attention(q, k, v, causal=True, return_lse=True)
    with_sink = ringlse.attention(q, k, v, causal=True, return_lse=True, sinks=s)
    assert all(torch.equal(a, b) for a, b in zip(plain, with_sink))


@pytest.mark.parametrize(("sinks", "message"), [(torch.zeros(3), r"one logit per query head, \[2\]"),
                                                (torch.zeros(2, dtype=torch.long), "floating-point")])
def test_bad_sinks_name_the_argument(sinks, message):
    q, k, v, *_ = _inputs(1, 4, 4, 2, 2, 8, seed=7)
    with pytest.raises(ValueError, match=message):
        ringlse.attention(q, k, v, sinks=sinks)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 10), st.integers(-1, 4), st.booleans(), st.integers(0, 2**16))
def test_property_sinks_with_random_windows(s, left, causal, seed):
    q, k, v, dout, dlse, sinks = _inputs(1, s, s, 2, 1, 4, seed=seed)
    sinks = sinks * 3
    ours = _grads(lambda *t: ringlse.attention(*t[:3], causal=causal, window_size=(left, left), sinks=t[3],
                                               return_lse=True), q, k, v, sinks, dout, dlse)
    ref = _grads(lambda *t: sink_oracle(*t[:3], range(s), range(s), causal, (left, left), None, t[3]),
                 q, k, v, sinks, dout, dlse)
    _check(ours, ref)


# ---- the ring ------------------------------------------------------------------------------------

def ring_with_sinks(rank, world, cases):
    """Rings with sinks, every layout, against the oracle; d sinks summed over the ranks."""
    import torch.distributed as dist

    failures = []
    for c in cases:
        s = c["s"]
        q, k, v, dout, dlse, sinks = _inputs(1, s, s, 4, 2, 8, seed=c["seed"])
        kw = dict(causal=c["causal"], window_size=c["window"], cu_seqlens=c["docs"])
        local = [ringlse.shard(t, c["layout"]) for t in (q, k, v, dout)]
        leaves = [t.detach().requires_grad_() for t in (*local[:3], sinks)]
        out, lse = ringlse.ring_attention(*leaves[:3], layout=c["layout"], return_lse=True, sinks=leaves[3], **kw)
        ((out * local[3]).sum() + (lse * ringlse.shard(dlse, c["layout"], dim=2)).sum()).backward()
        d_sinks = leaves[3].grad.clone()
        dist.all_reduce(d_sinks)
        ours = [ringlse.unshard(t.detach(), c["layout"], dim=d) for t, d in
                ((out, 1), (lse, 2), (leaves[0].grad, 1), (leaves[1].grad, 1), (leaves[2].grad, 1))] + [d_sinks]
        ref = _grads(lambda *t: sink_oracle(*t[:3], range(s), range(s), *_mask(kw), t[3]), q, k, v, sinks, dout, dlse)
        try:
            _check(ours, ref)
        except AssertionError as e:
            failures.append(f"rank {rank} {c}: {str(e).splitlines()[0]}")
    bad = ringlse.shard(q, "contiguous")
    try:
        ringlse.ring_attention(bad, bad[:, :, :2], bad[:, :, :2], layout="contiguous",
                               sinks=torch.zeros(3 if rank == 0 else 4, dtype=F64))
        failures.append(f"rank {rank}: a bad sinks shape on rank 0 did not raise")
    except ValueError as e:
        if "sinks" not in str(e):
            failures.append(f"rank {rank}: {e}")
    return failures


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_ring_with_sinks_matches_the_oracle(world, tmp_path):
    s = 4 * world * 3
    cases = [dict(s=s, layout=layout, causal=causal, window=window, docs=docs, seed=i)
             for i, (layout, causal, window, docs) in enumerate([
                 ("zigzag", True, (-1, -1), None), ("contiguous", False, (-1, -1), [0, 5, s]),
                 ("stripe", True, (3, 0), [0, 1, s // 2 + 1, s])])]
    import test_sinks

    failures = [f for fs in run_ranks(test_sinks.ring_with_sinks, world, tmp_path, cases, timeout=240) for f in fs]
    assert not failures, "\n".join(failures[:10])


def test_compiled_sinks_equal_eager():
    q, k, v, dout, dlse, sinks = _inputs(1, 11, 11, 2, 1, 8, seed=8)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]

    def run(q_, k_, v_, s_):
        return ringlse.attention(q_, k_, v_, causal=True, sinks=s_, return_lse=True)

    ref = run(*leaves)
    ref_g = torch.autograd.grad((ref[0] * dout).sum() + (ref[1] * dlse).sum(), leaves)
    got = torch.compile(run, backend="aot_eager", fullgraph=True)(*leaves)
    got_g = torch.autograd.grad((got[0] * dout).sum() + (got[1] * dlse).sum(), leaves)
    for a, b in zip((*got, *got_g), (*ref, *ref_g)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,q_start,softcap", [(128, True, 0, 0.0), (128, False, 0, 0.0), (64, True, 0, 0.0),
                                                      (64, False, 0, 0.0), (128, True, -100, 0.0),
                                                      (128, True, -100, 30.0), (128, False, 0, 50.0)],
                         ids=["d128-causal", "d128-full", "d64-causal", "d64-full", "d128-empty-rows",
                              "d128-empty-rows-softcap30", "d128-full-softcap50"])
def test_gpu_kernel_fold_equals_the_fold_after(d, causal, q_start, softcap):
    """On the GPU the triton kernels fold the sinks in their epilogue (the Hopper kernels on sm_90): the
    same state as the plain call with the sinks folded in afterwards (`ringlse.sinks.fold_sinks`, tested
    against the oracle above), to bf16 rounding of out and float32 rounding of lse; rows that see no key
    give (0, sink)."""
    from ringlse.sinks import fold_sinks

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 1031, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    sinks = torch.randn(8, device="cuda", generator=g) * 3
    from ringlse.kernels.attention_fwd import attention_forward

    kw = dict(softmax_scale=d ** -0.5, causal=causal, q_start=q_start, k_start=0, softcap=softcap)
    out, lse = attention_forward(q, k, v, sinks=sinks, **kw)
    plain, plain_lse = attention_forward(q, k, v, **kw)
    ref, ref_lse = fold_sinks(plain.float(), plain_lse, sinks)
    assert (out.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    if q_start < 0:  # the first 100 rows see no key
        assert (out[:, :100] == 0).all()
        torch.testing.assert_close(lse[:, :, :100], sinks[None, :, None].expand(2, 8, 100), rtol=1e-6, atol=1e-6)


def test_interpreted_kernel_fold_equals_the_fold_after():
    """The portable kernel's epilogue fold under Triton's interpreter (float32), rows without keys included."""
    from ringlse.sinks import fold_sinks

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 40, h, 16, generator=g) for h in (4, 2, 2))
    sinks = torch.tensor([0.5, -2.0, float("-inf"), 3.0])
    from ringlse.kernels.attention_fwd import attention_forward

    kw = dict(softmax_scale=0.25, causal=True, q_start=-10, k_start=0)
    out, lse = attention_forward(q, k, v, sinks=sinks, **kw)
    ref, ref_lse = fold_sinks(*attention_forward(q, k, v, **kw), sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    assert (out[:, :10] == 0).all() and torch.isneginf(lse[:, 2]).sum() == 10
