"""Logit softcapping and a V head dim other than Q/K's through the Python layers (issue 54): every
single-device entry point, the triton block op under the interpreter, the gloo ring, the refusals and
torch.compile, against the float64 oracle of `softcap_workers` (written there, not ringlse's reference).

softcap `s`: scores become `s * tanh(scale * q.k / s)` before the softmax, and the lse is over the capped
scores. d_v != d_qk: q, k `[..., d_qk]`, v and out `[..., d_v]`, default scale `d_qk ** -0.5`.
"""

from __future__ import annotations

import pytest
import torch

import ringlse
from dist_harness import run_ranks
from ringlse.blocks.sdpa import SDPA_BLOCK_OP
from softcap_workers import oracle, ring_cases, ring_refusals

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Triton interpreter's

# (softcap, d_qk, d_v): softcap alone, a V head dim alone, both
FEATURES = [(0.8, 8, 8), (0.0, 12, 8), (1.5, 8, 12)]
# masks with rows that see nothing (causal with more queries than keys, bottom-right; block_attention's
# queries before its keys; varlen's document without keys)
MASKS = [dict(causal=True), dict(causal=True, window=(2, -1)), dict(causal=True, docs=[0, 3, 9, 15])]


def _draw(sq, sk, d, dv, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, sq, 4, d), (2, sk, 2, d), (2, sk, 2, dv), (2, sq, 4, dv), (2, 4, sq))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def _grads(fn, q, k, v, dout, dlse):
    """`(out, lse, dq, dk, dv)` of `fn(q, k, v) -> (out, lse)` under the loss `out.dout + lse.dlse`
    (lse's -inf entries carry no loss)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    loss = (out.double() * dout.double()).sum() + (lse.double().nan_to_num(neginf=0.0) * dlse).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves))


def _check(ours, ref, close=None):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ours, ref):
        assert not a.isnan().any(), name
        if close is None:
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
        else:
            err = (a.double() - b).nan_to_num(posinf=0.0, neginf=0.0).abs().max()
            bound = close * b[torch.isfinite(b)].abs().max()
            assert err <= bound, f"{name}: max error {float(err):.3e} > {float(bound):.3e}"
            assert torch.equal(a.isneginf(), b.isneginf()), name


def _entry_points(mask, softcap, backend):
    """`name -> (call, oracle)`, each `(q, k, v) -> (out, lse)` over `[2, 13, 4, d]` q, `[2, 9, 2, d]` k/v."""
    causal, window, docs = mask.get("causal", False), mask.get("window", (-1, -1)), mask.get("docs")
    kw = dict(causal=causal, window_size=window, cu_seqlens=docs, softcap=softcap, backend=backend)
    om = dict(causal=causal, window=window, docs=docs, softcap=softcap)
    sq, sk = 13, 9
    bottom_right = range(sk - sq, sk)
    vq, vk = [0, 5, 9, 13], [0, 4, 4, 9]  # varlen: three documents, one with no keys
    cases = {
        "attention": (lambda q, k, v: ringlse.attention(q, k, v, return_lse=True, **kw),
                      lambda q, k, v: oracle(q, k, v, bottom_right, range(sk), **om)),
        "chunked_attention": (lambda q, k, v: ringlse.chunked_attention(q, k, v, chunk_size=4, return_lse=True, **kw),
                              lambda q, k, v: oracle(q, k, v, bottom_right, range(sk), **om)),
        "block_attention": (lambda q, k, v: ringlse.block_attention(q, k, v, q_start=2, k_start=5, **kw),
                            lambda q, k, v: oracle(q, k, v, range(2, 2 + sq), range(5, 5 + sk), **om)),
    }
    if docs is None:  # varlen's documents are its own

        def varlen(q, k, v):
            out, lse = ringlse.varlen_attention(q[0], k[0], v[0], vq, vk, causal=causal, window_size=window,
                                                softcap=softcap, backend=backend, return_lse=True)
            return out[None], lse[None]

        def varlen_oracle(q, k, v):
            outs, lses = [], []
            for a, b, c, e in zip(vq, vq[1:], vk, vk[1:]):
                o, l_ = oracle(q[:1, a:b], k[:1, c:e], v[:1, c:e], range(e - c - (b - a), e - c), range(e - c), **om)
                outs.append(o)
                lses.append(l_)
            return torch.cat(outs, 1), torch.cat(lses, 2)

        cases["varlen_attention"] = (varlen, varlen_oracle)
    return cases


@pytest.mark.parametrize("mask", MASKS, ids=["causal", "window", "documents"])
@pytest.mark.parametrize("softcap,d,dv", FEATURES, ids=["softcap", "dv", "both"])
def test_entry_points_match_the_oracle(mask, softcap, d, dv):
    q, k, v, _, _ = _draw(13, 9, d, dv, seed=1)
    q = q * 2  # scores past the cap
    dout, dlse = _draw(13, 9, d, dv, seed=2)[3:]
    for name, (call, ref) in _entry_points(mask, softcap, "torch").items():
        if name == "varlen_attention":  # one batch row
            args = (q[:1], k[:1], v[:1], dout[:1], dlse[:1])
        else:
            args = (q, k, v, dout, dlse)
        ours, theirs = _grads(call, *args), _grads(ref, *args)
        assert ours[0].shape[-1] == dv and ours[2].shape == args[0].shape and ours[4].shape == args[2].shape
        if name != "varlen_attention":
            assert ours[1].isneginf().any(), f"{name}: the case has no empty row"
        _check(ours, theirs)


def test_auto_picks_a_backend_that_takes_them():
    q, k, v, dout, dlse = _draw(13, 9, 12, 8)
    ours = _grads(lambda *t: ringlse.attention(*t, causal=True, softcap=0.5, return_lse=True), q, k, v, dout, dlse)
    _check(ours, _grads(lambda *t: oracle(*t, range(-4, 9), range(9), causal=True, softcap=0.5), q, k, v, dout, dlse))


def test_softcap_zero_is_off_and_bit_identical():
    q, k, v, _, _ = _draw(13, 9, 8, 8)
    a = ringlse.attention(q, k, v, causal=True, return_lse=True)
    b = ringlse.attention(q, k, v, causal=True, return_lse=True, softcap=0.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("mask", MASKS, ids=["causal", "window", "documents"])
@pytest.mark.parametrize("softcap,d,dv", [(0.8, 16, 16), (0.0, 24, 16), (1.5, 24, 16)], ids=["softcap", "dv", "both"])
def test_triton_interpreted(mask, softcap, d, dv):
    """The triton block op (the CPU interpreter, float32) against the oracle, §7's float32 bound."""
    pytest.importorskip("triton")
    q, k, v, dout, dlse = _draw(13, 9, d, dv, seed=3, dtype=torch.float32)
    q = q * 2
    cases = _entry_points(mask, softcap, "triton")
    for name in ("attention", "block_attention"):
        call, ref = cases[name]
        ours = _grads(call, q, k, v, dout, dlse)
        theirs = _grads(ref, *(t.double() for t in (q, k, v, dout)), dlse)
        _check(ours, theirs, close=1e-3)


@pytest.mark.parametrize("softcap,d,dv", FEATURES, ids=["softcap", "dv", "both"])
def test_backends_without_them_refuse_by_name(softcap, d, dv):
    q, k, v, _, _ = _draw(13, 9, d, dv, dtype=torch.float32)
    feature = "softcap" if softcap else f"V head dim {dv} differs from Q/K head dim {d}"
    calls = [lambda: ringlse.attention(q, k, v, softcap=softcap, backend=SDPA_BLOCK_OP),
             lambda: ringlse.chunked_attention(q, k, v, chunk_size=4, softcap=softcap, backend=SDPA_BLOCK_OP),
             lambda: ringlse.block_attention(q, k, v, softcap=softcap, backend=SDPA_BLOCK_OP),
             lambda: ringlse.varlen_attention(q[0], k[0], v[0], [0, 13], [0, 9], softcap=softcap,
                                              backend=SDPA_BLOCK_OP)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"{feature}.*backends that take it: torch, triton"):
            call()
    for name in ("sdpa", "fa2", "flash"):  # by name: refused before the device is looked at
        with pytest.raises(ValueError, match=rf"{feature}.*backends that take it: torch, triton"):
            ringlse.attention(q, k, v, softcap=softcap, backend=name)


def test_registry_lists_agree_with_the_ops():
    """`SOFTCAP_BACKENDS` / `V_HEAD_DIM_BACKENDS` (what `auto` and names are checked against) say what the
    ops' `Capabilities` say, for every op that imports here; a backend named on a device it cannot run on
    is refused for the feature first (so `auto` on a GPU never picks one without it)."""
    import importlib

    from ringlse.blocks import _BACKENDS, backend_unavailable_reason
    from ringlse.checks import SOFTCAP_BACKENDS, V_HEAD_DIM_BACKENDS

    for name, (module, attr, _, _) in _BACKENDS.items():
        try:
            op = getattr(importlib.import_module(module), attr)
        except ImportError:
            continue
        assert op.caps.softcap == (name in SOFTCAP_BACKENDS), name
        assert op.caps.v_head_dim == (name in V_HEAD_DIM_BACKENDS), name
    for name in ("sdpa", "fa2", "flash"):
        why = backend_unavailable_reason(name, "cuda", torch.bfloat16, softcap=30.0)
        assert "softcap 30" in why and "backends that take it: torch, triton, fa4" in why
        why = backend_unavailable_reason(name, "cuda", torch.bfloat16, head_dim=192, v_head_dim=128)
        assert "V head dim 128 differs from Q/K head dim 192" in why
    # fa4 takes both (where FlashAttention-4 runs at all); other pairs of head dims it refuses by name
    for features in (dict(softcap=30.0), dict(head_dim=192, v_head_dim=128)):
        why = backend_unavailable_reason("fa4", "cuda", torch.bfloat16, **features)
        assert why is None or ("softcap" not in why and "head dim" not in why), why
    why = backend_unavailable_reason("fa4", "cuda", torch.bfloat16, head_dim=128, v_head_dim=64)
    assert "(Q/K 128, V 64)" in why
    assert backend_unavailable_reason("torch", "cuda", torch.bfloat16, softcap=30.0, head_dim=192, v_head_dim=128) \
        is None


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_softcap_is_named(bad):
    q = torch.randn(1, 4, 2, 8)
    for call in (lambda: ringlse.attention(q, q, q, softcap=bad), lambda: ringlse.block_attention(q, q, q, softcap=bad),
                 lambda: ringlse.chunked_attention(q, q, q, softcap=bad, chunk_size=2),
                 lambda: ringlse.varlen_attention(q[0], q[0], q[0], [0, 4], [0, 4], softcap=bad)):
        with pytest.raises(ValueError, match="softcap must be 0"):
            call()


def test_reference_takes_them():
    q, k, v, _, _ = _draw(13, 9, 12, 8)
    out, lse = ringlse.reference_attention(q, k, v, causal=True, softcap=0.7)
    r_out, r_lse = oracle(q, k, v, range(-4, 9), range(9), causal=True, softcap=0.7)
    torch.testing.assert_close(out, r_out)
    torch.testing.assert_close(lse, r_lse)


def test_compiled_equals_eager_bit_for_bit():
    q, k, v, _, _ = _draw(13, 9, 12, 8)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def run(q, k, v):
        out, lse = ringlse.attention(q, k, v, causal=True, softcap=0.9, return_lse=True)
        return out, lse

    eager = run(*leaves)
    g_eager = torch.autograd.grad(eager[0].sum(), leaves)
    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)(*leaves)
    g_comp = torch.autograd.grad(compiled[0].sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip((*eager, *g_eager), (*compiled, *g_comp)))


RING_CASES = [dict(s=12, layout=layout, causal=causal, softcap=0.8, seed=i, **extra)
              for i, (layout, causal, extra) in enumerate([
                  ("contiguous", False, {}), ("zigzag", True, {}), ("stripe", True, {}),
                  ("contiguous", True, dict(window=(3, 0))), ("zigzag", True, dict(docs=[0, 5, 12])),
                  ("stripe", False, dict(window=(2, 2), docs=[0, 7, 12]))])]


@pytest.mark.parametrize("world", [2, 3])
def test_ring_softcap_matches_the_oracle(world, tmp_path):
    cases = [c for c in RING_CASES if c["layout"] != "zigzag" or c["s"] % (2 * world) == 0]
    for failures in run_ranks(ring_cases, world, tmp_path, cases, timeout=240):
        assert failures == []


def test_ring_refuses_on_every_rank(tmp_path):
    per_rank = run_ranks(ring_refusals, 2, tmp_path, timeout=120)
    for messages in per_rank:
        sdpa, dv, negative, disagree = messages
        assert "softcap" in sdpa and "backends that take it: torch, triton" in sdpa
        assert "V head dim 16 differs from Q/K head dim 8" in dv and "backends that take it: torch, triton" in dv
        assert "softcap must be 0" in negative
        assert "softcap" in disagree and "no error" != disagree
