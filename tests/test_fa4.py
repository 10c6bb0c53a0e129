"""The `fa4` block op (FlashAttention-4, `flash_attn.cute`) and the `flash` / `fa4` / `fa2` registry.

On CPU: a stand-in `flash_attn.cute` (installed into `sys.modules` by a fixture) with flash-attn-4
4.0.0b36's signatures for `interface._flash_attn_fwd`, `interface._flash_attn_bwd` and
`flash_attn_func`, computing with dense float64 PyTorch math under FA4's conventions: causal and
windows aligned bottom-right, window bounds None = unbounded (two negative bounds: unbounded), the
default scale `1/sqrt(head_dim)` of the (padded) head dim, lse `[b, h, sq]` float32 with `-inf` on
rows that see no key, fp16/bf16 and head dims 8..256 in multiples of 8 only, GQA native, a backward
that takes the global out/lse, reads an lse of `-inf` as 0 (as FA4's preprocessing does) and
subtracts `dlse` from `rowsum(dout * out)`. The op runs through `ringlse.block_attention(...,
backend=FA4_BLOCK_OP)` (a BlockOp skips the device check) and is judged against the float64
`reference_attention` by CONVENTIONS.md §7 in float16 (what FA4 takes); the piece logic and the
native lse-gradient backward are also checked exactly in float64 through the same op built over the
stand-in's math (`bottom_right_block_op`).

On GPU (skipped without FlashAttention-4 or below sm90): the real FA4 through `backend="fa4"` in bf16,
on the same paths.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import itertools
import math
import sys
import types

import pytest
import torch

import ringlse
from ringlse.blocks.contract import Masks, Parts
import ringlse.blocks as registry
from ringlse.blocks import fa4 as block_fa4
from ringlse.blocks import flash as block_flash
from ringlse.blocks.fa4 import FA4_BLOCK_OP, Band, fa4_causal_pieces, fa4_mask_args, split_causal_block_bottom_right
from ringlse.blocks.fused import fused_block_parts
from ringlse.reference import reference_attention
from fa4_checks import _block, _qkv, check_against_reference, judge_merged_block

F64 = torch.float64
HALF = (torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# the stand-in: FA4's conventions in dense float64 math


def fa4_visible(sq: int, sk: int, causal: bool, wl, wr) -> torch.Tensor:
    """FA4's mask `[sq, sk]`: `_resolve_causal_local_window` (two negative bounds: unbounded; causal:
    right bound 0), then bottom-right bands (key j visible to query i iff
    `i + sk - sq - left <= j <= i + sk - sq + right`, a None bound unbounded)."""
    if wl is not None and wr is not None and wl < 0 and wr < 0:
        wl = wr = None
    if causal:
        wr = 0
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + (sk - sq)
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if wr is not None:
        vis &= j <= diag + wr
    if wl is not None:
        vis &= j >= diag - wl
    return vis


def _rep(x: torch.Tensor, h: int) -> torch.Tensor:
    return x.double().repeat_interleave(h // x.shape[2], dim=2)  # query head hh reads kv head hh // group


def math_forward(q, k, v, scale, vis):
    """`(out, lse)` in float64: out `[b, sq, h, d]`, lse `[b, h, sq]` (`-inf`, out 0 on empty rows)."""
    h = q.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q.double(), _rep(k, h)) * scale
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, _rep(v, h)), lse


def math_backward(dout, q, k, v, out, lse, scale, vis, dlse):
    """FA4's backward in float64: P from the given lse (-inf read as 0), delta from the given out, minus dlse."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kk, vv = _rep(k, h), _rep(v, h)
    lse = lse.double()
    lse = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    s = (torch.einsum("bihd,bjhd->bhij", q.double(), kk) * scale).masked_fill(~vis, float("-inf"))
    p = torch.exp(s - lse[..., None])
    dp = torch.einsum("bihd,bjhd->bhij", dout.double(), vv)
    delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    if dlse is not None:
        delta = delta - dlse.double()
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhij,bjhd->bihd", ds, kk) * scale
    dk = (torch.einsum("bhij,bihd->bjhd", ds, q.double()) * scale).reshape(b, sk, hkv, h // hkv, -1).sum(3)
    dv = torch.einsum("bhij,bihd->bjhd", p, dout.double()).reshape(b, sk, hkv, h // hkv, -1).sum(3)
    return dq, dk, dv


def _defaults_only(fn, bound: dict, used: set[str]) -> None:
    """The stand-in supports the arguments in `used`; every other one must keep its default."""
    for name, p in inspect.signature(fn).parameters.items():
        if name in used or p.default is inspect.Parameter.empty:
            continue
        val = bound[name]
        assert val is p.default or (not isinstance(val, torch.Tensor) and val == p.default), (
            f"stand-in {fn.__name__}: {name}={val!r} is not supported")


def _check_inputs(q, k, v):
    assert q.dtype in HALF and q.dtype == k.dtype == v.dtype, "inputs must be float16 or bfloat16"
    d = q.shape[-1]
    assert 8 <= d <= 256 and d % 8 == 0 and k.shape[-1] == d == v.shape[-1], f"head_dim {d} not supported on SM90"
    assert q.shape[2] % k.shape[2] == 0, "num_head must be divisible by num_head_kv"
    assert q.shape[0] == k.shape[0] == v.shape[0] and k.shape[:3] == v.shape[:3]
    assert all(t.stride(-1) == 1 for t in (q, k, v))


def make_fa4_stand_in(*, drop_dlse: bool = False) -> types.ModuleType:
    """`flash_attn.cute` with `interface._flash_attn_fwd`, `interface._flash_attn_bwd` and
    `flash_attn_func` (signatures of flash-attn-4 4.0.0b36). `drop_dlse`: a `_flash_attn_bwd`
    without `dlse` (an interface the op must refuse). `calls` counts the calls and logs their masks."""
    calls = {"fwd": 0, "bwd": 0, "masks": []}

    def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                        causal=False, softcap=None, window_size_left=None, window_size_right=None,
                        learnable_sink=None, tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384,
                        num_splits=1, pack_gqa=None, _arch=None, score_mod=None, mask_mod=None,
                        block_sparse_tensors=None, return_lse=False, out=None, lse=None, aux_tensors=None,
                        aux_scalars=None, q_descale=None, k_descale=None, v_descale=None, gather_kv_indices=None,
                        scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                        gather_bwd_recompute_p=False):
        _defaults_only(_flash_attn_fwd, locals(), {"q", "k", "v", "softmax_scale", "causal", "window_size_left",
                                                   "window_size_right", "return_lse"})
        _check_inputs(q, k, v)
        calls["fwd"] += 1
        calls["masks"].append(("fwd", q.shape[1], k.shape[1], causal, window_size_left, window_size_right))
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(q.shape[-1])
        vis = fa4_visible(q.shape[1], k.shape[1], causal, window_size_left, window_size_right)
        o, l = math_forward(q, k, v, softmax_scale, vis)
        requires_grad = any(t.requires_grad for t in (q, k, v))
        return o.to(q.dtype), (l.float() if return_lse or requires_grad else None), None, None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
                        num_threads=256, pack_gqa=False, num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False,
                        dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2,
                        V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
                        score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
                        block_sparse_tensors=None, dlse=None, learnable_sink=None):
        _defaults_only(_flash_attn_bwd, locals(), {"q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal",
                                                   "window_size_left", "window_size_right", "dlse"})
        _check_inputs(q, k, v)
        b, sq, h, _ = q.shape
        assert out.shape == dout.shape == q.shape[:3] + v.shape[-1:] and out.dtype == dout.dtype == q.dtype
        assert lse.shape == (b, h, sq) and lse.dtype == torch.float32, "lse must be float32 (batch, nheads, seqlen_q)"
        assert dlse is None or (dlse.shape == (b, h, sq) and dlse.dtype == torch.float32), "dLSE must be Float32"
        calls["bwd"] += 1
        calls["masks"].append(("bwd", sq, k.shape[1], causal, window_size_left, window_size_right))
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(q.shape[-1])
        vis = fa4_visible(sq, k.shape[1], causal, window_size_left, window_size_right)
        grads = math_backward(dout, q, k, v, out, lse, softmax_scale, vis, dlse)
        return tuple(g.to(q.dtype) for g in grads)

    if drop_dlse:
        good_bwd = _flash_attn_bwd

        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                            window_size_left=None, window_size_right=None):
            return good_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left, window_size_right)

    def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                        window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                        deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                        aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None,
                        return_lse=False, gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
        _defaults_only(flash_attn_func, locals(), {"q", "k", "v", "softmax_scale", "causal", "window_size",
                                                   "return_lse"})
        with torch.no_grad():  # forward only: the tests need no autograd through it
            out, lse, *_ = _flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                           window_size_left=window_size[0], window_size_right=window_size[1],
                                           return_lse=return_lse)
        return out, lse  # 4.0.0b36 returns the pair, lse None without return_lse

    iface = types.ModuleType("flash_attn.cute.interface")
    iface.__spec__ = importlib.machinery.ModuleSpec("flash_attn.cute.interface", None)
    iface._flash_attn_fwd, iface._flash_attn_bwd, iface.flash_attn_func = _flash_attn_fwd, _flash_attn_bwd, flash_attn_func
    cute = types.ModuleType("flash_attn.cute")
    cute.__path__ = []
    cute.__spec__ = importlib.machinery.ModuleSpec("flash_attn.cute", None, is_package=True)
    cute.__version__ = "0.0.0"  # what 4.0.0b36 reports (it asks for a distribution named "fa4")
    cute.interface, cute.flash_attn_func, cute.calls = iface, flash_attn_func, calls
    return cute


def _clear_caches():
    block_fa4._load.cache_clear()
    registry._flash_attn_2_missing.cache_clear()
    block_flash._interface.cache_clear()


def _install(monkeypatch, cute: types.ModuleType | None, fa2: bool = False) -> None:
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    for name in ("flash_attn.cute", "flash_attn.cute.interface"):
        monkeypatch.setitem(sys.modules, name, None)  # import -> ImportError unless installed below
    if cute is not None:
        pkg.cute = cute
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", cute.interface)
    if fa2:
        fa2_iface = types.ModuleType("flash_attn.flash_attn_interface")
        pkg.flash_attn_interface, pkg.__version__ = fa2_iface, "2.8.3"
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", fa2_iface)
    else:
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    _clear_caches()


@pytest.fixture
def fake_fa4(monkeypatch):
    cute = make_fa4_stand_in()
    _install(monkeypatch, cute)
    yield cute
    _clear_caches()


@pytest.fixture
def registry_env(monkeypatch):
    """Install stand-ins and pretend a GPU: `registry_env(fa4=..., fa2=..., capability=(9, 0))`."""

    def setup(*, fa4: bool, fa2: bool, capability: tuple[int, int]):
        _install(monkeypatch, make_fa4_stand_in() if fa4 else None, fa2=fa2)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    yield setup
    _clear_caches()


# ------------------------------------------------------------------------------------------------
# pieces: exhaustive, exact (no kernels)


def _rule(sq, sk, q_start, k_start, causal=True, window=(-1, -1)):
    """ringlse's rule (CONVENTIONS.md §4, §10) as a dense `[sq, sk]` mask."""
    p = torch.arange(q_start, q_start + sq)[:, None]
    t = torch.arange(k_start, k_start + sk)[None, :]
    left, right = window
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        vis &= t <= p
    if left >= 0:
        vis &= t >= p - left
    if right >= 0:
        vis &= t <= p + right
    return vis


@pytest.mark.parametrize("sq,sk", list(itertools.product(range(0, 7), range(0, 7))))
def test_bottom_right_pieces_cover_the_causal_block_exactly_once(sq, sk):
    for q_start, k_start in itertools.product(range(0, 9), range(0, 9)):
        want = _rule(sq, sk, q_start, k_start)
        cover = torch.zeros(sq, sk, dtype=torch.int64)
        pieces = split_causal_block_bottom_right(sq, sk, q_start, k_start)
        assert len(pieces) <= 2
        rows = []
        for p in pieces:
            nq, nk = p.q1 - p.q0, p.k1 - p.k0
            assert 0 <= p.q0 < p.q1 <= sq and 0 <= p.k0 < p.k1 <= sk
            if p.causal:
                assert nq <= nk  # bottom-right causal with no empty row
            vis = fa4_visible(nq, nk, p.causal, None, None)
            assert vis.any(1).all(), "a piece row that sees nothing"
            cover[p.q0:p.q1, p.k0:p.k1] += vis.long()
            rows += range(p.q0, p.q1)
        assert len(rows) == len(set(rows)), "pieces share query rows"
        assert torch.equal(cover, want.long()), (sq, sk, q_start, k_start, pieces)


@pytest.mark.parametrize("sq,sk", list(itertools.product(range(0, 7), range(0, 7))))
def test_fa4_pieces_cover_the_causal_block_exactly_once(sq, sk):
    """`fa4_causal_pieces`: one FA4 call with a right window bound wherever every row sees a key, the
    bottom-right pieces elsewhere; either way every visible pair exactly once, no row that sees nothing."""
    for q_start, k_start in itertools.product(range(0, 9), range(0, 9)):
        want = _rule(sq, sk, q_start, k_start)
        cover = torch.zeros(sq, sk, dtype=torch.int64)
        pieces = fa4_causal_pieces(sq, sk, q_start, k_start)
        for p in pieces:
            nq, nk = p.q1 - p.q0, p.k1 - p.k0
            if isinstance(p.causal, Band):
                assert (p.q0, p.q1, p.k0, p.k1) == (0, sq, 0, sk) and p.causal.right > 0
                vis = fa4_visible(nq, nk, False, None, p.causal.right)
            else:
                vis = fa4_visible(nq, nk, p.causal, None, None)
            assert vis.any(1).all(), "a piece row that sees nothing"
            cover[p.q0:p.q1, p.k0:p.k1] += vis.long()
        assert torch.equal(cover, want.long()), (sq, sk, q_start, k_start, pieces)
        if q_start > k_start and want.any(1).all() and not want.all():
            assert len(pieces) == 1, (sq, sk, q_start, k_start, pieces)


def test_bottom_right_pieces_of_the_common_blocks():
    P = block_fa4.Piece
    assert split_causal_block_bottom_right(8, 8, 0, 0) == [P(0, 8, 0, 8, True)]  # diagonal: one call
    assert split_causal_block_bottom_right(4, 8, 4, 0) == [P(0, 4, 0, 8, True)]  # bottom-right: one call
    assert split_causal_block_bottom_right(8, 8, 4, 0) == [P(0, 4, 0, 8, True), P(4, 8, 0, 8, False)]
    assert split_causal_block_bottom_right(8, 8, 8, 0) == [P(0, 8, 0, 8, False)]  # fully visible
    assert split_causal_block_bottom_right(8, 8, 0, 1) == [P(1, 8, 0, 7, True)]  # stripe: k_start = 1
    assert split_causal_block_bottom_right(8, 8, 0, 8) == []  # nothing visible


# ------------------------------------------------------------------------------------------------
# fa4_mask_args: ringlse's rule -> FA4's native (causal, window_size)


WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (2, 5), (0, -1), (-1, 0)]


def test_mask_args_give_fa4_the_same_visible_pairs():
    mapped = refused = 0
    for sq, sk, q_start, k_start, causal, window in itertools.product(
            (1, 3, 6), (1, 4, 6), (0, 2, 7), (0, 3), (False, True), WINDOWS):
        try:
            fa4_causal, (wl, wr) = fa4_mask_args(sq, sk, q_start, k_start, causal, window)
        except ValueError as err:
            assert "negative window bound" in str(err)
            refused += 1
            continue
        mapped += 1
        assert wl is None or wl >= 0
        assert wr is None or wr >= 0
        assert (wl, wr) != (-1, -1)
        got = fa4_visible(sq, sk, fa4_causal, wl, wr)
        assert torch.equal(got, _rule(sq, sk, q_start, k_start, causal, window)), (sq, sk, q_start, k_start, causal, window)
    assert mapped > 100 and refused > 10


def test_mask_args_map_unbounded_to_none():
    assert fa4_mask_args(8, 8, 0, 0, False) == (False, (None, None))
    assert fa4_mask_args(8, 8, 0, 0, True) == (True, (None, None))  # plain diagonal: FA4's causal
    assert fa4_mask_args(4, 8, 4, 0, True) == (True, (None, None))  # bottom-right
    assert fa4_mask_args(8, 8, 4, 0, True) == (False, (None, 4))  # the ring's partial block
    assert fa4_mask_args(8, 8, 0, 0, False, (2, -1)) == (False, (2, None))
    assert fa4_mask_args(8, 8, 0, 0, True, (2, -1)) == (False, (2, 0))
    with pytest.raises(ValueError, match=r"negative window bound \(right -1\)"):
        fa4_mask_args(8, 8, 0, 1, True)  # stripe: FA4 would need right = -1
    with pytest.raises(ValueError, match="window_size left must be an int >= -1"):
        fa4_mask_args(8, 8, 0, 0, True, (-2, 0))


def test_mask_args_through_the_stand_ins_flash_attn_func(fake_fa4):
    g = torch.Generator().manual_seed(3)
    sq, sk, h, d = 24, 40, 4, 16
    q = torch.randn(1, sq, h, d, generator=g).half()
    k, v = (torch.randn(1, sk, 2, d, generator=g).half() for _ in "kv")
    for q_start, causal, window in [(16, True, (-1, -1)), (30, True, (-1, -1)), (16, False, (5, 3)), (20, True, (7, -1))]:
        fa4_causal, ws = fa4_mask_args(sq, sk, q_start, 0, causal, window)
        out, lse = fake_fa4.flash_attn_func(q, k, v, softmax_scale=0.3, causal=fa4_causal, window_size=ws, return_lse=True)
        ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal=causal, softmax_scale=0.3,
                                               q_start=q_start, k_start=0, window_size=window)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-3, rtol=2e-3)
    out, lse = fake_fa4.flash_attn_func(q, k, v)
    assert lse is None and out.shape == q.shape


# ------------------------------------------------------------------------------------------------
# the op against the reference


# (b, sq, sk, h, hkv, d, causal, q_start, k_start): every kind of block at global offsets
CASES = [  # head dims FA4's backward computes right (fa4.VERIFIED_HEAD_DIMS)
    pytest.param((2, 97, 97, 4, 4, 88, True, 0, 0), id="diag-b2-s97-d88"),
    pytest.param((1, 40, 97, 2, 2, 32, True, 57, 0), id="bottom-right-1call"),
    pytest.param((1, 64, 64, 4, 2, 24, True, 32, 0), id="partial-2pieces-gqa"),
    pytest.param((1, 97, 65, 4, 2, 88, True, 40, 30), id="offset-gqa"),
    pytest.param((1, 80, 30, 2, 1, 24, True, 10, 0), id="more-queries-than-keys-mqa"),
    pytest.param((1, 33, 50, 3, 1, 24, True, 0, 20), id="masked-rows-mqa"),
    pytest.param((1, 48, 48, 2, 2, 56, True, 0, 1), id="stripe-d56"),
    pytest.param((1, 40, 50, 2, 1, 24, True, 50, 0), id="off-diagonal-full"),
    pytest.param((1, 20, 30, 2, 2, 24, True, 0, 40), id="empty"),
    pytest.param((2, 33, 50, 4, 2, 64, False, 0, 0), id="not-causal-gqa"),
]


@pytest.mark.parametrize("lse_grad", [True, False], ids=["lse-grad", "no-lse-grad"])
@pytest.mark.parametrize("case", CASES)
def test_fa4_op_with_stand_in(case, lse_grad, fake_fa4):
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    check_against_reference(
        _block(FA4_BLOCK_OP, causal, q_start, k_start), b, sq, sk, h, hkv, d, torch.float16, "cpu",
        lse_grad=lse_grad, seed=sum(case) % 1000, causal=causal, q_start=q_start, k_start=k_start,
    )


def test_fa4_op_call_pattern(fake_fa4):
    """One FA4 call for a causal block whose diagonal sits right of FA4's (the ring's off-diagonal
    partial block: FA4's right window bound), forward and backward, the lse gradient passed as dlse
    (no extra passes); everything unbounded is None, the scale is always passed."""
    run = _block(FA4_BLOCK_OP, True, 32, 0, scale=0.2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(1, 64, 64, 2, 2, 56, torch.float16, "cpu", gen)
    out, lse = run(q, k, v)
    assert fake_fa4.calls["masks"] == [("fwd", 64, 64, False, None, 32)]
    (out.float().sum() + lse.sum()).backward()
    assert fake_fa4.calls["fwd"] == 1 and fake_fa4.calls["bwd"] == 1
    assert fake_fa4.calls["masks"][1:] == [("bwd", 64, 64, False, None, 32)]
    # a missing scale would have made the stand-in use its default 56 ** -0.5
    ref_out, ref_lse = reference_attention(q.detach().double(), k.detach().double(), v.detach().double(), causal=True,
                                           softmax_scale=0.2, q_start=32, k_start=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_fa4_op_accumulators(fake_fa4):
    """forward with out_acc/lse_acc views into larger buffers merges the block into the state."""
    b, sq, sk, h, hkv, d, q_start, k_start = 2, 97, 65, 4, 2, 88, 40, 30
    gen = torch.Generator().manual_seed(13)
    q, k, v = (x.detach() for x in _qkv(b, sq, sk, h, hkv, d, torch.float16, "cpu", gen))
    buf = torch.full((b, 2 * sq, h, d), float("nan"))
    lbuf = torch.full((b, h, 2 * sq), float("nan"))
    out_acc, lse_acc = buf[:, sq:], lbuf[:, :, sq:]
    out_acc.copy_(torch.randn(out_acc.shape, generator=gen))
    lse_acc.copy_(torch.randn(lse_acc.shape, generator=gen) * 2)
    lse_acc[0, 1, :5] = float("-inf")
    out_acc[0, :5, 1] = 0
    state0 = (out_acc.clone().double(), lse_acc.clone().double())
    res = FA4_BLOCK_OP.forward(q, k, v, softmax_scale=d**-0.5, causal=True, q_start=q_start, k_start=k_start,
                               out_acc=out_acc, lse_acc=lse_acc)
    assert res[0] is out_acc and res[1] is lse_acc
    assert torch.isnan(buf[:, :sq]).all() and torch.isnan(lbuf[:, :, :sq]).all(), "wrote outside the views"
    judge_merged_block(out_acc, lse_acc, state0, q, k, v, q_start, k_start, torch.float16)


DOC_BOUNDS = [[0, 30, 30, 77, 97], [0, 1, 50, 97]]


@pytest.mark.parametrize("bounds", DOC_BOUNDS, ids=["with-empty-doc", "with-single-token-doc"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fa4_op_documents_run_per_document(bounds, causal, fake_fa4):
    def run(q, k, v):
        return ringlse.attention(q, k, v, causal=causal, cu_seqlens=bounds, return_lse=True, backend=FA4_BLOCK_OP)

    check_against_reference(run, 1, 97, 97, 4, 2, 32, torch.float16, "cpu", lse_grad=True, seed=5, causal=causal,
                            cu_seqlens=bounds)
    n_docs = sum(1 for a, b in zip(bounds, bounds[1:]) if b > a)
    assert fake_fa4.calls["fwd"] == n_docs  # one plain FA4 call per non-empty document


# (sq, sk, causal, window, cu_seqlens): windows as FA4's own bounds, one call per block (or per document)
WINDOW_CASES = [
    pytest.param((97, 97, True, (5, -1), None), id="causal-left5"),
    pytest.param((97, 97, False, (0, 3), None), id="right3"),
    pytest.param((97, 97, False, (7, 7), None), id="both7"),
    pytest.param((97, 97, False, (0, 0), None), id="window0"),
    pytest.param((97, 97, True, (300, -1), None), id="wider-than-S"),
    pytest.param((40, 97, True, (9, -1), None), id="bottom-right-fewer-queries"),
    pytest.param((97, 40, False, (3, 2), None), id="more-queries-rows-see-nothing"),
    pytest.param((97, 97, True, (6, -1), [0, 30, 31, 77, 97]), id="causal-window-documents"),
]


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_fa4_op_windows(case, fake_fa4):
    sq, sk, causal, window, docs = case

    def run(q, k, v):
        return ringlse.attention(q, k, v, causal=causal, window_size=window, cu_seqlens=docs, return_lse=True,
                                 backend=FA4_BLOCK_OP)

    check_against_reference(run, 2, sq, sk, 4, 2, 32, torch.float16, "cpu", lse_grad=True, seed=sq + sk,
                            causal=causal, window_size=window, cu_seqlens=docs)
    n_docs = 1 if docs is None else sum(1 for a, b in zip(docs, docs[1:]) if b > a)
    assert fake_fa4.calls["fwd"] <= n_docs  # one FA4 call per block (per document), windows native


@pytest.mark.parametrize("window", [(5, -1), (3, 4)], ids=["causal-left5", "left3-right4"])
def test_fa4_op_windows_over_chunks_and_offsets(window, fake_fa4):
    """Key chunks and blocks at global offsets: each call is cut to the rows that see keys, so FA4's
    bounds never go negative (a far-left chunk would need them)."""
    causal = window[1] == -1

    def chunked(q, k, v):
        return ringlse.chunked_attention(q, k, v, causal=causal, window_size=window, chunk_size=16, return_lse=True,
                                         backend=FA4_BLOCK_OP)

    check_against_reference(chunked, 1, 97, 97, 2, 1, 24, torch.float16, "cpu", lse_grad=True, seed=3,
                            causal=causal, window_size=window)

    def block(q, k, v):
        return ringlse.block_attention(q, k, v, causal=causal, window_size=window, q_start=50, k_start=41,
                                       backend=FA4_BLOCK_OP)

    check_against_reference(block, 1, 33, 20, 2, 1, 24, torch.float16, "cpu", lse_grad=False, seed=4,
                            causal=causal, window_size=window, q_start=50, k_start=41)


def test_fa4_op_refuses_other_dtypes_and_strided_ring_windows(fake_fa4):
    q = torch.randn(1, 8, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp16/bf16 only"):
        FA4_BLOCK_OP.forward(q.float(), q.float(), q.float(), softmax_scale=0.25, causal=False, q_start=0, k_start=0)
    with pytest.raises(ValueError, match="windows and documents in the 'stripe' layout need a backend that takes"):
        ringlse.ring_attention(q, q, q, window_size=(2, 0), layout="stripe", backend=FA4_BLOCK_OP)
    # in layouts of contiguous runs the ring takes the window as a rule, as one device does
    q = torch.randn(1, 8, 2, 32, dtype=torch.float16)
    ring = ringlse.ring_attention(q, q, q, window_size=(2, 0), cu_seqlens=[0, 5, 8], backend=FA4_BLOCK_OP)
    one = ringlse.attention(q, q, q, window_size=(2, 0), cu_seqlens=[0, 5, 8], backend=FA4_BLOCK_OP)
    assert torch.equal(ring, one)
    with pytest.raises(ValueError, match="sdpa does not take windows"):
        ringlse.attention(q, q, q, window_size=(2, 0), backend="sdpa")
    assert FA4_BLOCK_OP.caps.masks is Masks.WINDOW and FA4_BLOCK_OP.delta is None
    assert isinstance(FA4_BLOCK_OP.accumulation, Parts)


def test_fa4_op_without_fa4_is_a_clear_error(monkeypatch):
    _install(monkeypatch, None)
    try:
        q = torch.randn(1, 8, 2, 24, dtype=torch.float16)
        with pytest.raises(RuntimeError, match="the fa4 backend needs FlashAttention-4: .*does not import"):
            FA4_BLOCK_OP.forward(q, q, q, softmax_scale=0.25, causal=False, q_start=0, k_start=0)
    finally:
        _clear_caches()


def test_fa4_interface_without_dlse_is_refused(monkeypatch):
    _install(monkeypatch, make_fa4_stand_in(drop_dlse=True))
    try:
        why = block_fa4.interface_missing()
        assert why is not None and "_flash_attn_bwd lacks the arguments ['dlse']" in why and "4.0.0b36" in why
    finally:
        _clear_caches()


def ring_worker(rank, world, cases):
    """On a spawned gloo rank: the ring with the fa4 op over the stand-in; rank 0 judges each case."""
    from ringlse.testing import judge_all, random_inputs, ring_with_grads

    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    cute = make_fa4_stand_in()
    sys.modules.update({"flash_attn": pkg, "flash_attn.cute": cute, "flash_attn.cute.interface": cute.interface})
    report = []
    for case in cases:
        q, k, v, dout, dlse = random_inputs(1, case["s"], 4, case["hkv"], 24, torch.float16, case["seed"], "cpu")
        dlse = dlse if case["lse_grad"] else None
        ours = ring_with_grads(q, k, v, dout, dlse, causal=case["causal"], layout=case["layout"],
                               backend=FA4_BLOCK_OP, return_lse=case["lse_grad"])
        if rank == 0:
            verdicts = judge_all(ours, q, k, v, dout, dlse, causal=case["causal"])
            report.append((case, [(v_.ok, str(v_)) for v_ in verdicts]))
    return report, cute.calls["fwd"], cute.calls["bwd"]


def test_fa4_op_in_the_ring_on_two_cpu_ranks(tmp_path):
    """The ring's off-diagonal blocks (zigzag, stripe: k_start = 1, contiguous) through the fa4 op's
    forward and backward parts, against the reference (two gloo ranks, the stand-in on each)."""
    from dist_harness import run_ranks

    cases = [dict(s=64, hkv=2, causal=True, layout="zigzag", lse_grad=True, seed=1),
             dict(s=64, hkv=1, causal=True, layout="stripe", lse_grad=False, seed=2),
             dict(s=64, hkv=4, causal=False, layout="contiguous", lse_grad=True, seed=3),
             dict(s=64, hkv=2, causal=True, layout="contiguous", lse_grad=False, seed=4)]
    per_rank = run_ranks(ring_worker, 2, tmp_path, cases, timeout=240)
    report, fwd_calls, bwd_calls = per_rank[0]
    assert len(report) == len(cases) and fwd_calls > len(cases) and bwd_calls > len(cases)
    bad = [f"{case['layout']} causal={case['causal']}: {text}" for case, verdicts in report
           for ok, text in verdicts if not ok]
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------------
# the same op over the stand-in's math in float64: pieces and the native lse gradient, exactly


def _f64_forward(q, k, v, causal, scale):
    out, lse = math_forward(q, k, v, scale, fa4_visible(q.shape[1], k.shape[1], causal, None, None))
    return out.to(q.dtype), lse


def _f64_backward(dout, q, k, v, out, lse, causal, scale, dlse=None):
    grads = math_backward(dout, q, k, v, out, lse, scale, fa4_visible(q.shape[1], k.shape[1], causal, None, None), dlse)
    return tuple(g.to(q.dtype) for g in grads)


F64_OP = block_fa4.bottom_right_block_op("fa4-math", _f64_forward, _f64_backward)


@pytest.mark.parametrize("case", CASES)
def test_bottom_right_op_exact_in_float64(case):
    b, sq, sk, h, hkv, d, causal, q_start, k_start = case
    check_against_reference(_block(F64_OP, causal, q_start, k_start, scale=0.17), b, sq, sk, h, hkv, d, F64, "cpu",
                            lse_grad=True, seed=sum(case) % 1000, scale=0.17, causal=causal, q_start=q_start,
                            k_start=k_start)


def test_kernels_without_the_features_are_refused_them_by_name():
    """A bottom-right op over kernels that take no softcap nor a V head dim of its own (this stand-in)
    says so, and is refused both by name; FA4's op takes them."""
    assert F64_OP.caps.softcap is False and F64_OP.caps.v_head_dim is False
    assert block_fa4.FA4_BLOCK_OP.caps.softcap and block_fa4.FA4_BLOCK_OP.caps.v_head_dim
    q = torch.randn(1, 8, 2, 16, dtype=F64)
    with pytest.raises(ValueError, match="softcap 30"):
        ringlse.attention(q, q, q, softcap=30.0, backend=F64_OP)
    with pytest.raises(ValueError, match="V head dim 8 differs from Q/K head dim 16"):
        ringlse.attention(q, q, q[..., :8], backend=F64_OP)


def test_native_lse_gradient_equals_the_drivers_term():
    """dlse passed to the kernels = the shared driver's generic lse-gradient term (float64)."""
    b, sq, sk, h, hkv, d, q_start, k_start = 1, 50, 40, 4, 2, 16, 30, 0
    gen = torch.Generator().manual_seed(9)
    q, k, v = (x.detach() for x in _qkv(b, sq, sk, h, hkv, d, F64, "cpu", gen))
    kw = dict(softmax_scale=0.3, causal=True, q_start=q_start, k_start=k_start)
    out, lse = F64_OP.forward(q, k, v, **kw)
    dout, e = torch.randn(out.shape, generator=gen, dtype=F64), torch.randn(lse.shape, generator=gen, dtype=F64)
    ks = block_fa4.KernelSet(forward=_f64_forward, backward=_f64_backward, native_gqa=True,
                             causal_pieces=split_causal_block_bottom_right)
    totals = []
    for fn in (F64_OP.backward, lambda *a, dq_acc, dk_acc, dv_acc, **kw_: _add(fused_block_parts(ks, *a, **kw_),
                                                                               (dq_acc, dk_acc, dv_acc))):
        accs = [torch.zeros_like(x) for x in (q, k, v)]
        fn(dout, q, k, v, out, lse, None, **kw, lse_grad=e, dq_acc=accs[0], dk_acc=accs[1], dv_acc=accs[2])
        totals.append(accs)
    for a, b_ in zip(*totals):
        torch.testing.assert_close(a, b_)


def _add(grads, accs):
    from ringlse.merge import add_parts

    for acc, parts in zip(accs, grads):
        add_parts(acc, parts)


# ------------------------------------------------------------------------------------------------
# registry: flash = fa4 on sm90+ where FA4 imports, else fa2


def test_cpu_lists_no_flashattention():
    names = ringlse.available_backends("cpu")
    assert not {"fa4", "fa2", "flash"} & set(names)
    for name in ("fa4", "fa2", "flash"):
        with pytest.raises(ValueError, match=rf"'{name}' is not available on cpu: {name} needs a CUDA device"):
            ringlse.get_block_op(name, "cpu")


def test_cpu_lists_no_flashattention_even_with_fa4_installed(fake_fa4):
    assert not {"fa4", "fa2", "flash"} & set(ringlse.available_backends("cpu"))


@pytest.mark.parametrize(
    "fa4,fa2,capability,want",
    [
        (True, False, (9, 0), "fa4"),
        (True, True, (9, 0), "fa4"),
        (True, True, (10, 0), "fa4"),
        (True, True, (8, 0), "fa2"),
        (False, True, (9, 0), "fa2"),
        (True, False, (8, 9), None),
        (False, False, (9, 0), None),
        (False, True, (7, 5), None),
    ],
    ids=["fa4-sm90", "both-sm90", "both-sm100", "both-sm80", "fa2-sm90", "fa4-sm89", "none", "fa2-sm75"],
)
def test_flash_is_the_best_flashattention_that_can_run(registry_env, fa4, fa2, capability, want):
    registry_env(fa4=fa4, fa2=fa2, capability=capability)
    listed = ringlse.available_backends("cuda", torch.bfloat16)
    assert ("fa4" in listed) == (want == "fa4")
    assert ("fa2" in listed) == (fa2 and capability >= (8, 0))
    assert ("flash" in listed) == (want is not None)
    if want is None:
        with pytest.raises(ValueError, match="'flash' is not available on cuda.*no FlashAttention can run here: "
                                             "fa4: .*; fa2: "):
            ringlse.get_block_op("flash", "cuda", torch.bfloat16)
        return
    op = ringlse.get_block_op("flash", "cuda", torch.bfloat16)
    assert op is (FA4_BLOCK_OP if want == "fa4" else block_flash.FA2_BLOCK_OP)
    assert op.name == want


def test_unavailable_reasons_name_the_cause(registry_env):
    registry_env(fa4=True, fa2=False, capability=(8, 6))
    reason = registry.backend_unavailable_reason("fa4", "cuda")
    assert reason == "FlashAttention-4 needs an sm90 or newer GPU, this one is sm86"
    reason = registry.backend_unavailable_reason("fa2", "cuda")
    assert "flash-attn 2 is not installed" in reason and "FlashAttention-4, flash_attn.cute, is installed" in reason
    assert registry.backend_unavailable_reason("fa4", "cuda", torch.float32) == (
        "fa4 does not compute torch.float32 (it takes torch.bfloat16, torch.float16)")
    assert registry.backend_unavailable_reason("fa4", "cuda", masked=True).startswith(
        "fa4 does not take windows or documents here (backends that do: triton, torch")
    with pytest.raises(ValueError, match="fa4 does not compute torch.float32"):
        ringlse.get_block_op("fa4", "cuda", torch.float32)


def test_fa4_missing_is_reported_without_a_gpu_query(registry_env, monkeypatch):
    registry_env(fa4=False, fa2=False, capability=(9, 0))

    def no_gpu(device=None):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    assert "does not import" in registry.backend_unavailable_reason("fa4", "cuda")
    _install(monkeypatch, make_fa4_stand_in())
    assert registry.backend_unavailable_reason("fa4", "cuda") == (
        "cannot read the GPU's compute capability: AssertionError: Torch not compiled with CUDA enabled")


def test_registry_entries_match_their_ops():
    for name in ("fa4", "fa2"):
        module, attr, dtypes, intervals = registry._BACKENDS[name]
        op = getattr(importlib.import_module(module), attr)
        assert op.name == name and (op.caps.masks is Masks.INTERVALS) == intervals and set(dtypes) == set(HALF)


@pytest.mark.parametrize("head_dim", [36, 40, 80, 112], ids=lambda d: f"d{d}")
def test_fa4_refuses_head_dims_whose_backward_is_unchecked_or_wrong(fake_fa4, head_dim):
    """FA4's backward gave a wrong dq on H200 for head dims 40 and 80 (and 36 zero-padded to 40 on H100);
    unchecked ones (112) are refused too: a ValueError instead of a silent wrong gradient."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = _qkv(1, 16, 16, 2, 2, head_dim, torch.float16, "cpu", gen)
    with pytest.raises(ValueError, match=f"takes head dims .*got {head_dim}"):
        _block(FA4_BLOCK_OP, True, 0, 0)(q, k, v)
