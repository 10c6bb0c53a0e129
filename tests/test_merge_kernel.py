"""The fused Triton merge (`ringlse.kernels.merge`) and its dispatch from `ringlse.merge`.

Without CUDA the kernel runs under Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1); the merge has no `tl.dot`, so bfloat16 is exact there too.

Tolerance (derived, tighter than the CONVENTIONS.md §7 float32 rule of 1e-3 * max|ref|): the reference is the
PyTorch merge in float64 of the very same inputs, so the only error is the kernel's float32 arithmetic.
Per row the kernel computes `exp(lse_i - m)` (argument rounding plus the hardware exp: a few ulp, and
`|x| e^x <= 1/e` bounds the argument part), one division, and a sum of at most four products (chained
launches for N > 32 add one float32 rounding of the intermediate state per launch). That is well under
16 float32 ulp of the largest output, so we allow `16 * eps32 * max|ref|` for `out`, plus one rounding
of the destination dtype (`eps_dtype * max|ref|`) when `out` is stored in fp16/bf16, and
`16 * eps32 * max(|ref_lse|, 1)` for `lse` (lse values of 1e4 carry 1e4 * eps32 ~ 1e-3 of rounding in
float32 already).
"""

from __future__ import annotations

import pytest
import torch

from ringlse import merge_states as merge_mod
from ringlse.merge_states import merge_attn_states, update_out_and_lse

pytest.importorskip("triton")
# not importorskip: with triton present, a missing ringlse.kernels is a broken install and must fail
import ringlse.kernels.merge as km  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps
NEG_INF = float("-inf")

SHAPES = [
    pytest.param((2, 97, 3, 80), id="b2-s97-h3-d80"),
    pytest.param((1, 33, 2, 64), id="b1-s33-h2-d64"),
    pytest.param((2, 3, 11, 4, 16), id="lead2x3-s11-h4-d16"),
]


def _lse_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-3], shape[-2], shape[-3])


def _draw_state(shape, dtype, device, gen, *, scale: float = 3.0, shift: float = 0.0):
    out = torch.randn(shape, generator=gen, device="cpu").to(device=device, dtype=dtype)
    lse = (torch.randn(_lse_shape(shape), generator=gen) * scale + shift).to(device)
    return out, lse


def _ref_merge(outs, lses):
    """float64 PyTorch merge of the same inputs."""
    return merge_attn_states([o.double().cpu() for o in outs], [l.double().cpu() for l in lses])


def _assert_state(out, lse, ref_out, ref_lse, out_dtype=torch.float32):
    out, lse = out.double().cpu(), lse.double().cpu()
    assert not torch.isnan(out).any(), "NaN in out (an element was not written?)"
    assert not torch.isnan(lse).any(), "NaN in lse (an element was not written?)"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "-inf rows differ"
    assert not torch.isposinf(lse).any()
    scale = ref_out.abs().max().item()
    tol_out = 16 * EPS32 * scale + (torch.finfo(out_dtype).eps * scale if out_dtype != torch.float32 else 0.0)
    err_out = (out - ref_out).abs().max().item()
    assert err_out <= tol_out, f"out: max err {err_out:.3e} > tol {tol_out:.3e}"
    finite = torch.isfinite(ref_lse)
    if finite.any():
        err_lse = (lse[finite] - ref_lse[finite]).abs().max().item()
        tol_lse = 16 * EPS32 * max(ref_lse[finite].abs().max().item(), 1.0)
        assert err_lse <= tol_lse, f"lse: max err {err_lse:.3e} > tol {tol_lse:.3e}"
    # -inf rows must come out exactly 0
    empty = torch.isneginf(ref_lse).transpose(-1, -2).unsqueeze(-1).expand_as(out)
    assert (out[empty] == 0).all()


def _poisoned(shape, dtype, device):
    return (
        torch.full(shape, float("nan"), dtype=dtype, device=device),
        torch.full(_lse_shape(shape), float("nan"), dtype=torch.float32, device=device),
    )


def _plant_inf_patterns(lses: list[torch.Tensor], gen) -> None:
    """-inf in some rows of each state alone, in rows where all states are -inf, and in a whole head."""
    flat = [l.view(-1, *l.shape[-2:]) for l in lses]
    s = flat[0].shape[-1]
    for i, l in enumerate(flat):
        l[0, 0, i % s] = NEG_INF  # one state alone
        l[-1, -1, (2 * i + 1) % s] = NEG_INF
        l[0, -1, s // 2] = NEG_INF  # every state: (0, -inf)
    if flat[0].shape[-2] > 1:
        for l in flat:
            l[-1, 0, :] = NEG_INF  # a whole head row empty everywhere


# ---------------------------------------------------------------------------------------------
# two states: in place (the running state) and into new tensors


@pytest.mark.parametrize("block_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES)
def test_update_in_place(shape, block_dtype, device):
    gen = torch.Generator().manual_seed(1)
    out, lse = _draw_state(shape, torch.float32, device, gen)
    blk, blk_lse = _draw_state(shape, block_dtype, device, gen)
    _plant_inf_patterns([lse, blk_lse], gen)
    ref_out, ref_lse = _ref_merge([out, blk], [lse, blk_lse])
    res = km.update_state_(out, lse, blk, blk_lse)
    assert res[0] is out and res[1] is lse
    _assert_state(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("shape", SHAPES)
def test_merge_two_into_new_tensors(shape, device):
    gen = torch.Generator().manual_seed(2)
    a, la = _draw_state(shape, torch.float32, device, gen)
    b, lb = _draw_state(shape, torch.float16, device, gen)
    _plant_inf_patterns([la, lb], gen)
    a0, la0, b0, lb0 = a.clone(), la.clone(), b.clone(), lb.clone()
    dst, dst_lse = _poisoned(shape, torch.float32, device)
    km.merge_states([a, b], [la, lb], dst, dst_lse)
    _assert_state(dst, dst_lse, *_ref_merge([a, b], [la, lb]))
    for x, x0 in ((a, a0), (la, la0), (b, b0), (lb, lb0)):
        assert torch.equal(x, x0), "an input was modified"


@pytest.mark.parametrize("shift", [1e4, -1e4], ids=["lse+1e4", "lse-1e4"])
def test_large_lse_is_stable(shift, device):
    shape = (2, 97, 3, 80)
    gen = torch.Generator().manual_seed(3)
    out, lse = _draw_state(shape, torch.float32, device, gen, shift=shift)
    blk, blk_lse = _draw_state(shape, torch.float16, device, gen, shift=shift)
    _plant_inf_patterns([lse, blk_lse], gen)
    ref_out, ref_lse = _ref_merge([out, blk], [lse, blk_lse])
    km.update_state_(out, lse, blk, blk_lse)
    assert torch.isfinite(out).all()
    _assert_state(out, lse, ref_out, ref_lse)


def test_every_state_empty(device):
    shape = (1, 9, 2, 16)
    gen = torch.Generator().manual_seed(4)
    out, _ = _draw_state(shape, torch.float32, device, gen)
    blk, _ = _draw_state(shape, torch.bfloat16, device, gen)
    lse = torch.full(_lse_shape(shape), NEG_INF, device=device)
    blk_lse = lse.clone()
    km.update_state_(out, lse, blk, blk_lse)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_empty_state_garbage_is_ignored(device):
    """A `-inf` state has weight exactly 0: whatever its `out` holds (even NaN) must not leak."""
    shape = (1, 7, 2, 16)
    gen = torch.Generator().manual_seed(5)
    out, lse = _draw_state(shape, torch.float32, device, gen)
    blk, blk_lse = _draw_state(shape, torch.float16, device, gen)
    blk_lse[0, 1, 3] = NEG_INF
    blk[0, 3, 1] = float("nan")
    ref_out, ref_lse = _ref_merge([out, torch.nan_to_num(blk)], [lse, blk_lse])
    km.update_state_(out, lse, blk, blk_lse)
    _assert_state(out, lse, ref_out, ref_lse)


def test_strided_views_in_place(device):
    """The ring merges into `buf[:, half:]`; blocks may come transposed; lse may be a transposed view."""
    b, s, h, d = 2, 97, 3, 80
    gen = torch.Generator().manual_seed(6)
    buf = torch.randn(b, 2 * s, h, d, generator=gen).to(device)
    lbuf = (torch.randn(b, h, 2 * s, generator=gen) * 3).to(device)
    buf0, lbuf0 = buf.clone(), lbuf.clone()
    out, lse = buf[:, s:], lbuf[:, :, s:]
    # block out from a [b, h, s, d] tensor, block lse from a [b, s, h] tensor: both non-contiguous views
    blk = torch.randn(b, h, s, d, generator=gen).to(device=device, dtype=torch.float16).transpose(1, 2)
    blk_lse = (torch.randn(b, s, h, generator=gen) * 3).to(device).transpose(1, 2)
    _plant_inf_patterns([lse, blk_lse], gen)
    assert not blk.is_contiguous() and not blk_lse.is_contiguous() and not out.is_contiguous()
    ref_out, ref_lse = _ref_merge([out, blk], [lse, blk_lse])
    km.update_state_(out, lse, blk, blk_lse)
    _assert_state(out, lse, ref_out, ref_lse)
    # the halves outside the views are untouched
    assert torch.equal(buf[:, :s], buf0[:, :s]) and torch.equal(lbuf[:, :, :s], lbuf0[:, :, :s])


# ---------------------------------------------------------------------------------------------
# N states


@pytest.mark.parametrize("n", [1, 3, 5], ids=["n1", "n3", "n5-tuple"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=["out-fp16", "out-fp32"])
def test_merge_n_states(n, out_dtype, device):
    shape = (2, 97, 3, 80)
    gen = torch.Generator().manual_seed(10 + n)
    outs, lses = [], []
    for i in range(n):
        o, l = _draw_state(shape, out_dtype if i == 0 else (torch.float16, torch.float32)[i % 2], device, gen)
        outs.append(o)
        lses.append(l)
    _plant_inf_patterns(lses, gen)
    ref_out, ref_lse = _ref_merge(outs, lses)
    dst, dst_lse = _poisoned(shape, out_dtype, device)
    km.merge_states(outs, lses, dst, dst_lse)
    _assert_state(dst, dst_lse, ref_out, ref_lse, out_dtype)


@pytest.mark.parametrize(("block_rows", "num_warps"), [(None, None), (1, 1)], ids=["default-tiles", "rows1-preload"])
def test_merge_n_states_of_their_own_strides(block_rows, num_warps, device):
    """A sequence of states of one shape but not one layout (a slice of a wider buffer, a tokens-first lse
    seen as its transpose): the tuple kernel reads each at its own strides (one-row tiles: every state
    loaded before any math)."""
    n = 6
    shape = (2, 97, 3, 80)
    gen = torch.Generator().manual_seed(30)
    outs, lses = [], []
    for i in range(n):
        o, l = _draw_state(shape, torch.float16, device, gen)
        if i == 2:  # two heads more in the buffer: other token and batch strides
            wide = torch.zeros(*shape[:-2], shape[-2] + 2, shape[-1], dtype=o.dtype, device=device)
            wide[..., 1:-1, :] = o
            o = wide[..., 1:-1, :]
        if i == 4:
            l = l.transpose(-1, -2).contiguous().transpose(-1, -2)
        outs.append(o)
        lses.append(l)
    assert len({o.stride() for o in outs}) > 1 and len({l.stride() for l in lses}) > 1
    _plant_inf_patterns(lses, gen)
    ref_out, ref_lse = _ref_merge(outs, lses)
    dst, dst_lse = _poisoned(shape, torch.float32, device)
    km.merge_states(outs, lses, dst, dst_lse, block_rows=block_rows, num_warps=num_warps)
    _assert_state(dst, dst_lse, ref_out, ref_lse, torch.float32)


def test_kernel_rejects_what_it_cannot_take(device):
    shape = (1, 4, 2, 8)
    o = torch.randn(shape, device=device)
    l = torch.randn(_lse_shape(shape), device=device)
    with pytest.raises(ValueError, match="need as many"):
        km.merge_states([o], [], o, l)
    with pytest.raises(ValueError, match="fp32 lse"):
        km.merge_states([o], [l.double()], o, l)
    every_other = torch.randn(*shape[:-1], 2 * shape[-1], device=device)[..., ::2]
    with pytest.raises(ValueError, match="stride 1"):
        km.merge_states([every_other], [l], o, l)


# ---------------------------------------------------------------------------------------------
# public API: inplace= on any device, kernel dispatch on CUDA


def test_update_out_and_lse_inplace_cpu():
    gen = torch.Generator().manual_seed(20)
    shape = (2, 9, 3, 8)
    for dtype in (torch.float32, torch.float64):
        out, lse = _draw_state(shape, dtype, "cpu", gen)
        lse = lse.to(dtype)
        blk, blk_lse = _draw_state(shape, torch.float16 if dtype == torch.float32 else dtype, "cpu", gen)
        _plant_inf_patterns([lse, blk_lse], gen)
        want_out, want_lse = update_out_and_lse(out, lse, blk, blk_lse)
        got = update_out_and_lse(out, lse, blk, blk_lse, inplace=True)
        assert got[0] is out and got[1] is lse
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    # starting a state with out=None returns new tensors, as without inplace
    o, l = update_out_and_lse(None, None, blk, blk_lse, inplace=True)
    assert o.dtype == torch.float64 and torch.equal(o, blk)
    with pytest.raises(ValueError, match="float32/float64"):
        update_out_and_lse(blk.half(), blk_lse, blk, blk_lse, inplace=True)


def test_update_out_and_lse_inplace_records_autograd():
    """While autograd records, the in-place update is differentiable and equals the out-of-place one."""
    gen = torch.Generator().manual_seed(21)
    shape = (1, 5, 2, 4)
    out, lse = _draw_state(shape, torch.float64, "cpu", gen)
    lse = lse.double()
    blk = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    blk_lse = torch.randn(_lse_shape(shape), generator=gen, dtype=torch.float64, requires_grad=True)
    o1, l1 = update_out_and_lse(out, lse, blk, blk_lse)
    g1 = torch.autograd.grad((o1.sin().sum() + l1.cos().sum()), (blk, blk_lse))
    o2, l2 = out.clone(), lse.clone()
    update_out_and_lse(o2, l2, blk, blk_lse, inplace=True)
    g2 = torch.autograd.grad((o2.sin().sum() + l2.cos().sum()), (blk, blk_lse))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
def test_public_update_uses_kernel_on_cuda(inplace, monkeypatch):
    calls = []
    real = km.merge_states
    monkeypatch.setattr(km, "merge_states", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(30)
    shape = (2, 1025, 8, 128)
    out, lse = _draw_state(shape, torch.float32, "cuda", gen)
    blk, blk_lse = _draw_state(shape, torch.bfloat16, "cuda", gen)
    _plant_inf_patterns([lse, blk_lse], gen)
    ref_out, ref_lse = _ref_merge([out, blk], [lse, blk_lse])
    got_out, got_lse = update_out_and_lse(out, lse, blk, blk_lse, inplace=inplace)
    assert calls, "the CUDA call did not go through the fused kernel"
    assert (got_out is out) == inplace
    _assert_state(got_out, got_lse, ref_out, ref_lse)


@pytest.mark.gpu
def test_public_merge_attn_states_uses_kernel_on_cuda(monkeypatch):
    calls = []
    real = km.merge_states
    monkeypatch.setattr(km, "merge_states", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(31)
    shape = (1, 1025, 4, 80)
    outs, lses = zip(*[_draw_state(shape, torch.bfloat16, "cuda", gen) for _ in range(3)])
    _plant_inf_patterns(list(lses), gen)
    out, lse = merge_attn_states(list(outs), list(lses))
    assert calls and out.dtype == torch.bfloat16
    _assert_state(out, lse, *_ref_merge(outs, lses), torch.bfloat16)


@pytest.mark.gpu
def test_public_merge_keeps_autograd_on_cuda():
    """Inputs that require grad take the differentiable PyTorch path, even on CUDA."""
    gen = torch.Generator().manual_seed(32)
    shape = (1, 64, 2, 32)
    out, lse = _draw_state(shape, torch.float32, "cuda", gen)
    blk, blk_lse = _draw_state(shape, torch.float32, "cuda", gen)
    blk.requires_grad_()
    m_out, m_lse = update_out_and_lse(out, lse, blk, blk_lse)
    assert m_out.grad_fn is not None
    (g,) = torch.autograd.grad(m_out.sum(), blk)
    w = torch.exp(blk_lse - m_lse).transpose(-1, -2).unsqueeze(-1).expand_as(g)
    torch.testing.assert_close(g, w)


@pytest.mark.gpu
def test_large_state_on_cuda():
    shape = (1, 4096, 32, 128)
    gen = torch.Generator().manual_seed(33)
    out, lse = _draw_state(shape, torch.float32, "cuda", gen)
    blk, blk_lse = _draw_state(shape, torch.bfloat16, "cuda", gen)
    _plant_inf_patterns([lse, blk_lse], gen)
    ref_out, ref_lse = _ref_merge([out, blk], [lse, blk_lse])
    km.update_state_(out, lse, blk, blk_lse)
    _assert_state(out, lse, ref_out, ref_lse)


def test_dispatch_is_lazy_and_cpu_stays_pytorch(monkeypatch):
    """CPU tensors never reach the kernel; `ringlse.merge` imports it only when asked."""
    monkeypatch.setattr(km, "merge_states", lambda *a, **k: pytest.fail("kernel called for CPU tensors"))
    shape = (1, 4, 2, 8)
    o, l = torch.randn(shape), torch.randn(_lse_shape(shape))
    update_out_and_lse(o, l, o, l)
    update_out_and_lse(o.clone(), l.clone(), o, l, inplace=True)
    merge_attn_states([o, o], [l, l])
    assert merge_mod._kernel_for([o, l], [o], [l], o, l) is None
