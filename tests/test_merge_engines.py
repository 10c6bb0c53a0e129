"""`merge_attn_states` / `update_out_and_lse` in the inference engines' conventions (CONVENTIONS.md §3):
lse layouts (`heads_first`, `tokens_first`), lse bases (e, 2), stacked inputs (`dim=`), destinations
(`out=`, `out_lse=`), on the PyTorch path (float64, CPU), through the fused kernel under Triton's
interpreter (fp16/fp32, CPU) and on the GPU (bf16).

The oracles are the engines' documented merges, written here from their documentation, not with
ringlse's `merge_weights`:
- vLLM `merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse)`: outputs
  `[T, H, D]`, lse `[H, T]`, natural log; `max_lse = max(p, s)`, `p_se = exp(p - max_lse)`,
  `s_se = exp(s - max_lse)`, `out = (p_se * o_p + s_se * o_s) / (p_se + s_se)`,
  `lse = log(p_se + s_se) + max_lse` (with the both-empty guard of vLLM PR #28181: out 0, lse -inf).
- FlashInfer `merge_state(v_a, s_a, v_b, s_b)`: `v [T, H, D]`, `s [T, H]` in base 2;
  `s_max = max(s_a, s_b)`, `a = 2^(s_a - s_max)`, `b = 2^(s_b - s_max)`, `v = (a v_a + b v_b)/(a + b)`,
  `s = s_max + log2(a + b)`; `merge_states(v [T, N, H, D], s [T, N, H])` the same over N.
- FlashAttention-4 `flash_attn_combine(out_partial [N, ..., T, H, D], lse_partial [N, ..., T, H])`:
  natural log, `lse = logsumexp_i lse_i`, `out = sum_i exp(lse_i - lse) out_i`.
Every oracle treats a row that is empty in every state as `(0, -inf)` (what the engines' fixes do).

Kernel tolerance (derived, tighter than the CONVENTIONS.md §7 float32 rule; same reasoning as
tests/test_merge_kernel.py): the oracle runs in float64 on the very same inputs, so the error is the
kernel's float32 arithmetic: a few ulp per weight, at most N products summed. We allow
`(16 + 2N) * eps32 * max_i |out_i|` for `out`, plus one rounding of a fp16/bf16 destination
(`eps_dtype * max|ref|`), and `16 * eps32 * max(|ref_lse|, 1)` for `lse`.
"""

from __future__ import annotations

import math

import pytest
import torch

import ringlse
from ringlse import merge_states as ms
from ringlse.merge_states import merge_attn_states, update_out_and_lse

F64 = torch.float64
NEG_INF = float("-inf")
EPS32 = torch.finfo(torch.float32).eps
LAYOUTS = ["heads_first", "tokens_first"]
BASES = [pytest.param(None, id="base-e"), pytest.param(2.0, id="base-2")]


# ---------------------------------------------------------------------------------------------------
# the engines' formulas (float64)


def _empty_guard(total, m):
    """`(divisor, lse shift)` of the both-empty guard: where every weight is 0, divide by 1 and give -inf."""
    return torch.where(total == 0, torch.ones_like(total), total), torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def vllm_merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse):
    """vLLM's merge of two states: outputs `[..., T, H, D]`, lse `[..., H, T]`, natural log."""
    p_lse, s_lse = prefix_lse.double(), suffix_lse.double()
    max_lse = torch.maximum(p_lse, s_lse)
    _, shift = _empty_guard(max_lse, max_lse)
    p_se, s_se = torch.exp(p_lse - shift), torch.exp(s_lse - shift)
    out_se = p_se + s_se
    denom, _ = _empty_guard(out_se, max_lse)
    p_scale = (p_se / denom).transpose(-1, -2).unsqueeze(-1)
    s_scale = (s_se / denom).transpose(-1, -2).unsqueeze(-1)
    output = prefix_output.double() * p_scale + suffix_output.double() * s_scale
    output_lse = torch.where(out_se == 0, torch.full_like(out_se, NEG_INF), torch.log(denom) + shift)
    return output, output_lse


def flashinfer_merge_state(v_a, s_a, v_b, s_b):
    """FlashInfer's `merge_state`: `v [..., T, H, D]`, `s [..., T, H]`, base 2."""
    s_a, s_b = s_a.double(), s_b.double()
    s_max = torch.maximum(s_a, s_b)
    _, shift = _empty_guard(s_max, s_max)
    a, b = torch.exp2(s_a - shift), torch.exp2(s_b - shift)
    denom, _ = _empty_guard(a + b, s_max)
    v = (v_a.double() * a.unsqueeze(-1) + v_b.double() * b.unsqueeze(-1)) / denom.unsqueeze(-1)
    s = torch.where(a + b == 0, torch.full_like(s_max, NEG_INF), shift + torch.log2(denom))
    return v, s


def flashinfer_merge_states(v, s):
    """FlashInfer's `merge_states`: `v [..., T, N, H, D]`, `s [..., T, N, H]`, base 2."""
    v, s = v.double(), s.double()
    s_max = s.amax(dim=-2, keepdim=True)
    _, shift = _empty_guard(s_max, s_max)
    e = torch.exp2(s - shift)
    total = e.sum(dim=-2, keepdim=True)
    denom, _ = _empty_guard(total, s_max)
    out = (v * (e / denom).unsqueeze(-1)).sum(dim=-3)
    lse = torch.where(total == 0, torch.full_like(total, NEG_INF), shift + torch.log2(denom)).squeeze(-2)
    return out, lse


def fa4_combine(out_partial, lse_partial):
    """FlashAttention-4's `flash_attn_combine`: `[N, ..., T, H, D]`, `[N, ..., T, H]`, natural log."""
    o, l = out_partial.double(), lse_partial.double()
    lse = torch.logsumexp(l, dim=0)
    _, shift = _empty_guard(lse, lse)
    scale = torch.where(torch.isneginf(l), torch.zeros_like(l), torch.exp(l - shift))
    return (o * scale.unsqueeze(-1)).sum(0), lse


def oracle(outs, lses, layout, base):
    """The merge of the states `outs[i]` `[..., T, H, D]`, `lses[i]` in `layout`/`base`, by the engine
    formula of that convention (heads-first base 2 has no engine: FlashInfer's pairwise formula on the
    transposed lses)."""
    base2 = base == 2.0
    # pairwise folds start from the empty state (0, -inf), so N = 1 goes through the formula too
    o = torch.zeros_like(outs[0], dtype=F64)
    if layout == "heads_first" and not base2:  # vLLM, folded pairwise
        l = torch.full_like(lses[0], NEG_INF, dtype=F64)
        for o_i, l_i in zip(outs, lses):
            o, l = vllm_merge_attn_states(o, l, o_i, l_i)
        return o, l
    if layout == "tokens_first" and base2:  # FlashInfer merge_states
        return flashinfer_merge_states(torch.stack(list(outs), dim=-3), torch.stack(list(lses), dim=-2))
    if layout == "tokens_first":  # FA4 combine
        return fa4_combine(torch.stack(list(outs)), torch.stack(list(lses)))
    l = torch.full_like(lses[0], NEG_INF, dtype=F64).transpose(-1, -2)
    for o_i, l_i in zip(outs, lses):
        o, l = flashinfer_merge_state(o, l, o_i, l_i.transpose(-1, -2))
    return o, l.transpose(-1, -2)


# ---------------------------------------------------------------------------------------------------
# inputs


SHAPES = [
    pytest.param((5, 2, 8), id="t5-h2-d8"),
    pytest.param((2, 97, 3, 80), id="b2-t97-h3-d80"),
]


def lse_shape(shape, layout):
    *lead, t, h, _ = shape
    return (*lead, h, t) if layout == "heads_first" else (*lead, t, h)


def draw_states(n, shape, layout, dtype=F64, seed=0, empty="partial"):
    """N states with -inf patterns: `partial`: rows empty in one state only, rows empty in every
    state; `all`: every row of every state empty; `none`."""
    gen = torch.Generator().manual_seed(seed)
    outs = [torch.randn(shape, generator=gen, dtype=F64).to(dtype) for _ in range(n)]
    lses = [(torch.randn(lse_shape(shape, layout), generator=gen, dtype=F64) * 3).to(F64 if dtype == F64 else torch.float32)
            for _ in range(n)]
    if empty == "all":
        for x in lses:
            x.fill_(NEG_INF)
    elif empty == "partial":
        t = shape[-3]
        for i, x in enumerate(lses):
            hf = x if layout == "heads_first" else x.transpose(-1, -2)  # [..., H, T] view
            view = hf[(0,) * (hf.dim() - 2)]  # the first batch entry's [H, T] (a view)
            view[0, i % t] = NEG_INF  # this state alone
            view[-1, t // 2] = NEG_INF  # every state: (0, -inf)
            if i != 0:
                view[0, (i + 1) % t] = NEG_INF
    return outs, lses


def stack(outs, lses, form, layout):
    """`(outs, lses, dim)` as the call takes them in `form`: `seq` (lists), `stack0` (FA4's `[N, ...]`),
    `engine` (FlashInfer's `[..., T, N, H, D]` for tokens-first; `[..., N, T, H, D]` with a negative
    dim for heads-first)."""
    if form == "seq":
        return list(outs), list(lses), None
    nd = outs[0].dim() + 1
    if form == "stack0":
        d = 0
    elif layout == "tokens_first":
        d = nd - 3  # [..., T, N, H, D]
    else:
        d = nd - 4  # [..., N, T, H, D]
    so, sl = torch.stack(list(outs), dim=d), torch.stack(list(lses), dim=d)
    return so, sl, (d - nd if form == "engine" else d)  # the engine form passes a negative dim


def destinations(shape, layout, out_dtype, lse_dtype, device="cpu"):
    """NaN-filled `out`/`out_lse` that are strided views into larger buffers."""
    *lead, t, h, d = shape
    big = torch.full((*lead, t + 3, h, d), float("nan"), dtype=out_dtype, device=device)
    out = big[..., 1 : t + 1, :, :]
    if layout == "heads_first":
        big_l = torch.full((*lead, h, t + 2), float("nan"), dtype=lse_dtype, device=device)
        out_lse = big_l[..., 2:]
    else:
        big_l = torch.full((*lead, t, h + 1), float("nan"), dtype=lse_dtype, device=device)
        out_lse = big_l[..., :h]
    return out, out_lse


def assert_exact(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out)
    torch.testing.assert_close(lse.double(), ref_lse)


def assert_kernel_close(out, lse, ref_out, ref_lse, outs, out_dtype):
    out, lse = out.double(), lse.double()
    assert not torch.isnan(out).any(), "NaN in out (an element was not written?)"
    assert not torch.isnan(lse).any(), "NaN in lse (an element was not written?)"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "-inf rows differ"
    scale_in = max(o.double().abs().max().item() for o in outs)
    scale_ref = ref_out.abs().max().item()
    tol = (16 + 2 * len(outs)) * EPS32 * scale_in
    if out_dtype != torch.float32:
        tol += torch.finfo(out_dtype).eps * scale_ref
    err = (out - ref_out).abs().max().item()
    assert err <= tol, f"out: max err {err:.3e} > tol {tol:.3e}"
    finite = torch.isfinite(ref_lse)
    if finite.any():
        err_l = (lse[finite] - ref_lse[finite]).abs().max().item()
        tol_l = 16 * EPS32 * max(ref_lse[finite].abs().max().item(), 1.0)
        assert err_l <= tol_l, f"lse: max err {err_l:.3e} > tol {tol_l:.3e}"


# ---------------------------------------------------------------------------------------------------
# the oracles agree with each other (they are what the tests below trust)


def test_oracles_agree():
    outs, lses = draw_states(3, (2, 7, 3, 4), "tokens_first", seed=1)
    fi = oracle(outs, lses, "tokens_first", 2.0)
    fa = fa4_combine(torch.stack(outs), torch.stack([x * math.log(2) for x in lses]))
    torch.testing.assert_close(fi[0], fa[0])
    torch.testing.assert_close(fi[1] * math.log(2), fa[1])
    hf = [x.transpose(-1, -2) * math.log(2) for x in lses]
    vl = oracle(outs, hf, "heads_first", None)
    torch.testing.assert_close(vl[0], fa[0])
    torch.testing.assert_close(vl[1].transpose(-1, -2), fa[1])
    assert torch.isneginf(fa[1][0, 3, -1]) and (fa[0][0, 3, -1] == 0).all()


# ---------------------------------------------------------------------------------------------------
# PyTorch path, float64: every layout x base x form x destination


@pytest.mark.parametrize("dest", ["new", "out"])
@pytest.mark.parametrize("form", ["seq", "stack0", "engine"])
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 16], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("shape", SHAPES)
def test_merge_matches_engine_formula(shape, n, layout, base, form, dest):
    outs, lses = draw_states(n, shape, layout, seed=n)
    ref_out, ref_lse = oracle(outs, lses, layout, base)
    copies = [t.clone() for t in (*outs, *lses)]
    o_in, l_in, dim = stack(outs, lses, form, layout)
    kw = dict(lse_layout=layout, lse_base=base, dim=dim)
    if dest == "out":
        out, out_lse = destinations(shape, layout, F64, F64)
        got = merge_attn_states(o_in, l_in, out=out, out_lse=out_lse, **kw)
        assert got[0] is out and got[1] is out_lse
    else:
        got = merge_attn_states(o_in, l_in, **kw)
    assert got[0].shape == tuple(shape) and got[1].shape == lse_shape(shape, layout)
    assert got[0].dtype == F64 and got[1].dtype == F64
    assert_exact(*got, ref_out, ref_lse)
    for t, c in zip((*outs, *lses), copies):
        assert torch.equal(t, c), "an input was modified"


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ["seq", "stack0"])
@pytest.mark.parametrize("n", [1, 2, 3], ids=lambda n: f"n{n}")
def test_every_state_empty(n, form, layout, base):
    shape = (4, 2, 8)
    outs, lses = draw_states(n, shape, layout, empty="all")
    o_in, l_in, dim = stack(outs, lses, form, layout)
    out, lse = merge_attn_states(o_in, l_in, lse_layout=layout, lse_base=base, dim=dim)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_dtype_and_float32_inputs(layout, base):
    """`out` of another float dtype than the inputs; float32 inputs (lse float32)."""
    shape = (2, 9, 3, 16)
    outs, lses = draw_states(3, shape, layout, dtype=torch.float32, seed=3)
    ref_out, ref_lse = oracle(outs, lses, layout, base)
    out, out_lse = destinations(shape, layout, torch.float16, torch.float32)
    merge_attn_states(outs, lses, lse_layout=layout, lse_base=base, out=out, out_lse=out_lse)
    assert_kernel_close(out, out_lse, ref_out, ref_lse, outs, torch.float16)
    only_out, _ = destinations(shape, layout, F64, torch.float32)
    got_out, got_lse = merge_attn_states(outs, lses, lse_layout=layout, lse_base=base, out=only_out)
    assert got_out is only_out and got_lse.dtype == torch.float32
    assert_kernel_close(got_out, got_lse, ref_out, ref_lse, outs, torch.float32)


# ---------------------------------------------------------------------------------------------------
# update_out_and_lse in every layout and base


@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_out_and_lse_layouts_and_bases(layout, base, inplace):
    shape = (2, 97, 3, 80)
    outs, lses = draw_states(3, shape, layout, seed=7)
    ref_out, ref_lse = oracle(outs, lses, layout, base)
    kw = dict(lse_layout=layout, lse_base=base)
    out, lse = update_out_and_lse(None, None, outs[0], lses[0], inplace=inplace, **kw)
    for o, x in zip(outs[1:], lses[1:]):
        new = update_out_and_lse(out, lse, o, x, inplace=inplace, **kw)
        assert (new[0] is out and new[1] is lse) == inplace
        out, lse = new
    assert lse.shape == lse_shape(shape, layout)
    assert_exact(out, lse, ref_out, ref_lse)


# ---------------------------------------------------------------------------------------------------
# float64 gradients


@pytest.mark.parametrize("form", ["seq", "stack0", "engine"])
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck(layout, base, form):
    shape = (1, 4, 2, 3)
    outs, lses = draw_states(3, shape, layout, seed=11, empty="none")
    # partially empty: -inf in one state at a time (never in all: finite differences of -inf are NaN)
    hf = [x if layout == "heads_first" else x.transpose(-1, -2) for x in lses]
    hf[0][0, 0, 1] = NEG_INF
    hf[2][0, 1, :2] = NEG_INF
    o_in, l_in, dim = stack(outs, lses, form, layout)
    kw = dict(lse_layout=layout, lse_base=base, dim=dim)
    if form == "seq":
        ts = [t.requires_grad_() for t in (*o_in, *l_in)]
        assert torch.autograd.gradcheck(lambda *t: merge_attn_states(t[:3], t[3:], **kw), ts)
    else:
        o_in.requires_grad_()
        l_in.requires_grad_()
        assert torch.autograd.gradcheck(lambda o, x: merge_attn_states(o, x, **kw), (o_in, l_in))
    if form == "seq":
        a, b = outs[0].detach().requires_grad_(), outs[1].detach().requires_grad_()
        la, lb = lses[0].detach().requires_grad_(), lses[1].detach().requires_grad_()
        ukw = dict(lse_layout=layout, lse_base=base)
        assert torch.autograd.gradcheck(lambda *t: update_out_and_lse(*t, **ukw), (a, la, b, lb))


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_zero_at_neginf_and_empty_rows(layout, base):
    shape = (6, 2, 4)
    outs, lses = draw_states(3, shape, layout, seed=12)  # partial pattern: row t//2 = 3 empty everywhere
    outs = [o.requires_grad_() for o in outs]
    lses = [x.requires_grad_() for x in lses]
    out, lse = merge_attn_states(outs, lses, lse_layout=layout, lse_base=base)
    g = torch.autograd.grad((out, lse), (*outs, *lses), (torch.randn_like(out), torch.randn_like(lse)))
    for gi in g:
        assert torch.isfinite(gi).all()
    for x, gl in zip(lses, g[3:]):
        assert (gl[torch.isneginf(x)] == 0).all()
    for o, gl, x in zip(outs, g[:3], lses):
        hf = x if layout == "heads_first" else x.transpose(-1, -2)
        dead = torch.isneginf(hf).transpose(-1, -2).unsqueeze(-1).expand_as(o)
        assert (gl[dead] == 0).all()


# ---------------------------------------------------------------------------------------------------
# errors


def test_errors_name_the_argument():
    shape = (1, 5, 2, 8)
    outs, lses = draw_states(2, shape, "heads_first", empty="none")
    tf = [x.transpose(-1, -2).contiguous() for x in lses]
    with pytest.raises(ValueError, match="lse_layout"):
        merge_attn_states(outs, lses, lse_layout="bhs")
    for bad in (3.0, "2", True, 10):
        with pytest.raises(ValueError, match="lse_base"):
            merge_attn_states(outs, lses, lse_base=bad)
    with pytest.raises(ValueError, match="lse_layout"):
        update_out_and_lse(outs[0], lses[0], outs[1], lses[1], lse_layout=None)
    with pytest.raises(ValueError, match="lse_base"):
        update_out_and_lse(outs[0], lses[0], outs[1], lses[1], lse_base=10.0)
    # shapes under the chosen layout
    with pytest.raises(ValueError, match="lse must have shape.*tokens_first"):
        merge_attn_states(outs, lses, lse_layout="tokens_first")
    with pytest.raises(ValueError, match="lse must have shape.*heads_first"):
        merge_attn_states(outs, tf)
    with pytest.raises(ValueError, match="lse must have shape"):
        update_out_and_lse(outs[0], tf[0], outs[1], tf[1])
    # dim
    so, sl = torch.stack(outs), torch.stack(lses)
    with pytest.raises(ValueError, match="need dim"):
        merge_attn_states(so, sl)
    with pytest.raises(ValueError, match="dim=0 is for stacked"):
        merge_attn_states(outs, lses, dim=0)
    with pytest.raises(ValueError, match="out of range"):
        merge_attn_states(so, sl, dim=5)
    with pytest.raises(ValueError, match="leading dim"):
        merge_attn_states(so, sl, dim=2)  # T, with heads-first lses
    with pytest.raises(ValueError, match="both be tensors"):
        merge_attn_states(so, lses, dim=0)
    with pytest.raises(ValueError, match="same number"):
        merge_attn_states(so, torch.stack([*lses, lses[0]]), dim=0)
    with pytest.raises(ValueError, match="one dim fewer"):
        merge_attn_states(so, so, dim=0)
    # destinations
    with pytest.raises(ValueError, match="out has shape"):
        merge_attn_states(outs, lses, out=torch.empty(1, 5, 2, 4, dtype=F64))
    with pytest.raises(ValueError, match="out must have a floating dtype"):
        merge_attn_states(outs, lses, out=torch.empty(shape, dtype=torch.int32))
    with pytest.raises(ValueError, match="out is on meta"):
        merge_attn_states(outs, lses, out=torch.empty(shape, dtype=F64, device="meta"))
    with pytest.raises(ValueError, match="out_lse must be torch.float64"):
        merge_attn_states(outs, lses, out_lse=torch.empty(1, 2, 5, dtype=torch.float32))
    with pytest.raises(ValueError, match="out_lse has shape"):
        merge_attn_states(outs, lses, out_lse=torch.empty(1, 5, 2, dtype=F64))
    with pytest.raises(ValueError, match="out shares memory with an input"):
        merge_attn_states(outs, lses, out=outs[0])
    with pytest.raises(ValueError, match="out_lse shares memory with an input"):
        merge_attn_states(so.unbind(0), sl.unbind(0), out_lse=sl[1])
    with pytest.raises(ValueError, match="out shares memory with an input"):
        merge_attn_states(so, sl, dim=0, out=so[0])
    with pytest.raises(ValueError, match="for inference"):
        merge_attn_states([outs[0].requires_grad_(), outs[1]], lses, out=torch.empty(shape, dtype=F64))


def test_out_under_no_grad_is_fine():
    shape = (1, 5, 2, 8)
    outs, lses = draw_states(2, shape, "heads_first", empty="none")
    outs = [o.requires_grad_() for o in outs]
    out = torch.empty(shape, dtype=F64)
    with torch.no_grad():
        got, _ = merge_attn_states(outs, lses, out=out)
    assert got is out and not out.requires_grad
    assert_exact(out, _, *oracle([o.detach() for o in outs], lses, "heads_first", None))


def test_reexports():
    assert ringlse.merge_attn_states is ms.merge_attn_states is merge_attn_states
    assert ringlse.update_out_and_lse is ms.update_out_and_lse is update_out_and_lse


# ---------------------------------------------------------------------------------------------------
# the fused kernel (Triton's interpreter on CPU, fp16/fp32), through the public API


@pytest.fixture
def kernel_calls(monkeypatch):
    """Route CPU tensors to the fused kernel (under the interpreter) and count its calls."""
    km = pytest.importorskip("ringlse.kernels.merge")
    calls = []
    if not torch.cuda.is_available():
        monkeypatch.setattr(ms, "_kernel_device", lambda tensors: all(t.device.type == "cpu" for t in tensors))
    for name in ("merge_states", "merge_stacked"):
        real = getattr(km, name)
        monkeypatch.setattr(km, name, (lambda real, name: lambda *a, **k: calls.append(name) or real(*a, **k))(real, name))
    return calls


KERNEL_SHAPE = (1, 97, 3, 80)


@pytest.mark.parametrize("dest", ["new", "out"])
@pytest.mark.parametrize("form", ["seq", "stack0", "engine"])
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_kernel_layouts_bases_forms(dtype, layout, base, form, dest, kernel_calls, device):
    n = 3
    outs, lses = draw_states(n, KERNEL_SHAPE, layout, dtype=dtype, seed=21)
    ref_out, ref_lse = oracle(outs, lses, layout, base)
    outs, lses = [o.to(device) for o in outs], [x.to(device) for x in lses]
    copies = [t.clone() for t in (*outs, *lses)]
    o_in, l_in, dim = stack(outs, lses, form, layout)
    kw = dict(lse_layout=layout, lse_base=base, dim=dim)
    if dest == "out":
        out, out_lse = destinations(KERNEL_SHAPE, layout, dtype, torch.float32, device)
        got = merge_attn_states(o_in, l_in, out=out, out_lse=out_lse, **kw)
        assert got[0] is out and got[1] is out_lse
    else:
        got = merge_attn_states(o_in, l_in, **kw)
    assert kernel_calls, "the fused kernel did not run"
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert_kernel_close(got[0].cpu(), got[1].cpu(), ref_out, ref_lse, [o.cpu() for o in outs], dtype)
    for t, c in zip((*outs, *lses), copies):
        assert torch.equal(t, c), "an input was modified"


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize(
    ("layout", "form", "n"),
    [
        pytest.param("tokens_first", "engine", 16, id="flashinfer-n16"),
        pytest.param("tokens_first", "stack0", 5, id="fa4-n5"),
        pytest.param("heads_first", "engine", 16, id="heads-first-n16"),
        pytest.param("heads_first", "seq", 5, id="seq-n5-tuple"),
        pytest.param("tokens_first", "seq", 16, id="seq-n16-tuple"),
    ],
)
def test_kernel_many_states(layout, form, n, base, kernel_calls, device):
    outs, lses = draw_states(n, KERNEL_SHAPE, layout, dtype=torch.float16, seed=22)
    ref_out, ref_lse = oracle(outs, lses, layout, base)
    outs, lses = [o.to(device) for o in outs], [x.to(device) for x in lses]
    o_in, l_in, dim = stack(outs, lses, form, layout)
    got = merge_attn_states(o_in, l_in, lse_layout=layout, lse_base=base, dim=dim)
    assert kernel_calls
    assert_kernel_close(got[0].cpu(), got[1].cpu(), ref_out, ref_lse, [o.cpu() for o in outs], torch.float16)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_stacked_kernel_for_few_states(layout, base, device):
    """The stacked kernel (forced) at N = 1, 2 equals the engines' formula too."""
    km = pytest.importorskip("ringlse.kernels.merge")
    for n in (1, 2):
        outs, lses = draw_states(n, KERNEL_SHAPE, layout, dtype=torch.float32, seed=23 + n)
        ref_out, ref_lse = oracle(outs, lses, layout, base)
        so, sl = torch.stack(outs).to(device), torch.stack(lses).to(device)
        out, out_lse = destinations(KERNEL_SHAPE, layout, torch.float32, torch.float32, device)
        km.merge_states(list(so), [ms._heads_first(x, layout) for x in sl], out, ms._heads_first(out_lse, layout),
                        base2=base == 2.0, stacked=True)
        assert_kernel_close(out.cpu(), out_lse.cpu(), ref_out, ref_lse, outs, torch.float32)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_every_state_empty(layout, base, kernel_calls, device):
    forms = ((1, "seq"), (2, "seq"), (1, "stack0"), (6, "stack0"), (6, "seq"))
    for n, form in forms:
        outs, lses = draw_states(n, (1, 9, 2, 16), layout, dtype=torch.float32, empty="all")
        o_in, l_in, dim = stack([o.to(device) for o in outs], [x.to(device) for x in lses], form, layout)
        out, lse = merge_attn_states(o_in, l_in, lse_layout=layout, lse_base=base, dim=dim)
        assert (out == 0).all() and torch.isneginf(lse).all()
    assert len(kernel_calls) == len(forms)


@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_update_out_and_lse(layout, base, inplace, kernel_calls, device):
    outs, lses = draw_states(2, KERNEL_SHAPE, layout, dtype=torch.float32, seed=24)
    outs[1] = outs[1].half()
    ref_out, ref_lse = oracle(outs, lses, layout, base)
    state = (outs[0].to(device), lses[0].to(device))
    got = update_out_and_lse(*state, outs[1].to(device), lses[1].to(device), inplace=inplace,
                             lse_layout=layout, lse_base=base)
    assert kernel_calls
    assert (got[0] is state[0]) == inplace and (got[1] is state[1]) == inplace
    assert_kernel_close(got[0].cpu(), got[1].cpu(), ref_out, ref_lse, outs, torch.float32)


# ---------------------------------------------------------------------------------------------------
# GPU: bf16 through the public API (the kernel serves CUDA tensors without autograd)


GPU_SHAPE = (1, 333, 32, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("dest", ["new", "out"])
@pytest.mark.parametrize("form", ["seq", "stack0", "engine"])
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [2, 16], ids=lambda n: f"n{n}")
def test_gpu_bf16(n, layout, base, form, dest, kernel_calls):
    outs, lses = draw_states(n, GPU_SHAPE, layout, dtype=torch.bfloat16, seed=31)
    ref_out, ref_lse = oracle(outs, lses, layout, base)
    outs, lses = [o.cuda() for o in outs], [x.cuda() for x in lses]
    o_in, l_in, dim = stack(outs, lses, form, layout)
    kw = dict(lse_layout=layout, lse_base=base, dim=dim)
    if dest == "out":
        out, out_lse = destinations(GPU_SHAPE, layout, torch.bfloat16, torch.float32, "cuda")
        got = merge_attn_states(o_in, l_in, out=out, out_lse=out_lse, **kw)
        assert got[0] is out and got[1] is out_lse
    else:
        got = merge_attn_states(o_in, l_in, **kw)
    assert kernel_calls, "the fused kernel did not run"
    assert_kernel_close(got[0].cpu(), got[1].cpu(), ref_out, ref_lse, [o.cpu() for o in outs], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_update_in_place(layout, base, kernel_calls):
    outs, lses = draw_states(2, GPU_SHAPE, layout, dtype=torch.float32, seed=32)
    outs[1] = outs[1].bfloat16()
    ref_out, ref_lse = oracle(outs, lses, layout, base)
    state = (outs[0].cuda(), lses[0].cuda())
    got = update_out_and_lse(*state, outs[1].cuda(), lses[1].cuda(), inplace=True, lse_layout=layout, lse_base=base)
    assert kernel_calls and got[0] is state[0]
    assert_kernel_close(got[0].cpu(), got[1].cpu(), ref_out, ref_lse, outs, torch.float32)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize(("n", "stacked"), [(2, False), (3, True), (16, True), (8, False)],
                         ids=["slots-n2", "stacked-n3", "stacked-n16", "tuple-n8"])
@pytest.mark.parametrize(("block_rows", "num_warps"), [(1, 1), (2, 1), (4, 2), (16, 1)],
                         ids=["rows1", "rows2", "rows4", "rows16"])
def test_kernel_small_tiles(block_rows, num_warps, n, stacked, base, device):
    """The small tiles the launcher picks for a few rows (decoding) on a GPU: one to four rows a program,
    every state loaded before any math; and 16 rows a warp, where the states are loaded in two passes."""
    km = pytest.importorskip("ringlse.kernels.merge")
    shape = (1, 3, 5, 80)
    outs, lses = draw_states(n, shape, "tokens_first", dtype=torch.float16, seed=25)
    ref_out, ref_lse = oracle(outs, lses, "tokens_first", base)
    so, sl = torch.stack(outs, 2).to(device), torch.stack(lses, 2).to(device)  # FlashInfer's [.., T, N, H, D]
    out, out_lse = destinations(shape, "tokens_first", torch.float16, torch.float32, device)
    km.merge_states(list(so.unbind(2)), [x.mT for x in sl.unbind(2)], out, out_lse.mT, base2=base == 2.0,
                    stacked=stacked, block_rows=block_rows, num_warps=num_warps)
    assert_kernel_close(out.cpu(), out_lse.cpu(), ref_out, ref_lse, outs, torch.float16)


@pytest.mark.parametrize("base", BASES)
def test_kernel_sequence_beyond_the_tuple_kernel_chains(base, device):
    """More separately allocated states than one tuple launch takes: chained launches, same result."""
    km = pytest.importorskip("ringlse.kernels.merge")
    n, shape = km.MAX_TUPLE_STATES + 2, (1, 5, 2, 16)
    outs, lses = draw_states(n, shape, "heads_first", dtype=torch.float32, seed=26)
    ref_out, ref_lse = oracle(outs, lses, "heads_first", base)
    out, out_lse = destinations(shape, "heads_first", torch.float32, torch.float32, device)
    km.merge_states([o.to(device) for o in outs], [x.to(device) for x in lses], out, out_lse, base2=base == 2.0)
    assert_kernel_close(out.cpu(), out_lse.cpu(), ref_out, ref_lse, outs, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("layout", "form", "n"),
    [
        pytest.param("tokens_first", "engine", 16, id="flashinfer-n16"),
        pytest.param("tokens_first", "stack0", 3, id="fa4-n3"),
        pytest.param("heads_first", "seq", 2, id="vllm-n2"),
        pytest.param("heads_first", "seq", 16, id="seq-n16"),
    ],
)
def test_gpu_out_allocates_nothing(layout, form, n):
    """With `out=` and `out_lse=` the CUDA call allocates no memory (the kernel writes the destinations)."""
    outs, lses = draw_states(n, (1, 333, 32, 128), layout, dtype=torch.bfloat16, seed=33)
    o_in, l_in, dim = stack([o.cuda() for o in outs], [x.cuda() for x in lses], form, layout)
    out, out_lse = destinations((1, 333, 32, 128), layout, torch.bfloat16, torch.float32, "cuda")
    kw = dict(lse_layout=layout, lse_base=2.0, dim=dim, out=out, out_lse=out_lse)
    merge_attn_states(o_in, l_in, **kw)  # compiles
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    merge_attn_states(o_in, l_in, **kw)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
