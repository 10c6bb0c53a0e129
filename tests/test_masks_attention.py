"""Windows and packed documents at global positions (CONVENTIONS.md §10), single device: every entry
point against a dense-mask oracle written here, pair by pair (not ringlse's reference), float64,
forward and backward."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ringlse
from ringlse.blocks.contract import Masks
from mask_oracle import oracle
from ringlse.blocks.sdpa import SDPA_BLOCK_OP

F64 = torch.float64


def _grads(fn, q, k, v, dout, dlse):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    loss = (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    loss.backward()
    return [out.detach(), lse.detach(), *(t.grad for t in leaves)]


def _inputs(b, sq, sk, h, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=F64) for shape in
            ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d), (b, h, sq))]


def _check(ours, ref):
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), ours, ref):
        torch.testing.assert_close(a, r, msg=lambda m: f"{name}: {m}")


WINDOWS = [(-1, -1), (0, 0), (3, -1), (-1, 2), (2, 5), (100, 100)]
DOCS = {"one": None, "empty-and-single": [0, 1, 1, 5, 13], "three": [0, 4, 9, 13], "whole": [0, 13]}


@pytest.mark.parametrize("docs", list(DOCS), ids=list(DOCS))
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{l}_{r}" for l, r in WINDOWS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_matches_the_oracle(causal, window, docs):
    q, k, v, dout, dlse = _inputs(2, 13, 13, 4, 2, 8, seed=1)
    bounds = DOCS[docs]
    ours = _grads(lambda q_, k_, v_: ringlse.attention(q_, k_, v_, causal=causal, window_size=window,
                                                       cu_seqlens=bounds, return_lse=True, backend="torch"),
                  q, k, v, dout, dlse)
    ref = _grads(lambda q_, k_, v_: oracle(q_, k_, v_, range(13), range(13), causal, window, bounds), q, k, v, dout, dlse)
    _check(ours, ref)


def test_torch_backend_takes_masks_on_the_inputs_device(device):
    """The `torch` op builds its dense mask from the plan's intervals (kept on the CPU) on the scores'
    device: on a GPU a mask left on the CPU failed every masked `torch` call (found by the 2-GPU ring
    tests). float64 on the inputs' device against the oracle."""
    q, k, v, dout, dlse = _inputs(2, 13, 13, 4, 2, 8, seed=2)
    window, bounds = (3, 1), [0, 1, 1, 5, 13]
    ours = _grads(lambda *t: ringlse.attention(*t, causal=True, window_size=window, cu_seqlens=bounds,
                                               return_lse=True, backend="torch"),
                  *(t.to(device) for t in (q, k, v, dout, dlse)))
    ref = _grads(lambda *t: oracle(*t, range(13), range(13), True, window, bounds), q, k, v, dout, dlse)
    _check([t.cpu() for t in ours], ref)


@pytest.mark.gpu
def test_planned_intervals_are_pinned_where_cuda_is():
    """Plans keep their intervals on the CPU and the kernels copy them to the GPU on every call: from
    pageable memory a copy of more than 64 KB waits for the GPU to reach it (42 of 48 ms of a 4-GPU ring
    call's host time), so they are pinned, cached blocks and larger ones alike."""
    from ringlse.masks import CACHED_ROWS, Rule, Span, planned_intervals

    rule = Rule(True, docs=(0, 300, CACHED_ROWS))
    for n in (1000, CACHED_ROWS):  # cached; over the cache's size, computed each time
        iv = planned_intervals(rule, Span(0, n), Span(0, n))
        assert all(t.is_pinned() for t in iv), n


@pytest.mark.parametrize(("q_start", "k_start"), [(0, 0), (5, 0), (0, 6), (20, 3)], ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (4, 1)], ids=["nowin", "win"])
def test_block_attention_at_global_positions(q_start, k_start, window):
    sq, sk = 7, 9
    end = max(q_start + sq, k_start + sk)
    bounds = [0, 3, 8, 8, 14, end] if end > 14 else [0, 3, 8, 8, end]
    q, k, v, dout, dlse = _inputs(1, sq, sk, 2, 1, 8, seed=2)
    ours = _grads(lambda *t: ringlse.block_attention(*t, causal=True, q_start=q_start, k_start=k_start,
                                                     window_size=window, cu_seqlens=bounds, backend="torch"),
                  q, k, v, dout, dlse)
    ref = _grads(lambda *t: oracle(*t, range(q_start, q_start + sq), range(k_start, k_start + sk), True, window, bounds),
                 q, k, v, dout, dlse)
    _check(ours, ref)


@pytest.mark.parametrize("chunk", [1, 4, 13], ids=lambda c: f"chunk{c}")
def test_chunked_attention_with_window_and_documents(chunk):
    q, k, v, dout, dlse = _inputs(1, 9, 13, 2, 2, 8, seed=3)  # bottom-right: queries at 4..12
    bounds, window = [0, 5, 6, 13], (3, 2)
    ours = _grads(lambda *t: ringlse.chunked_attention(*t, causal=True, chunk_size=chunk, window_size=window,
                                                       cu_seqlens=bounds, return_lse=True, backend="torch"),
                  q, k, v, dout, dlse)
    ref = _grads(lambda *t: oracle(*t, range(4, 13), range(13), True, window, bounds), q, k, v, dout, dlse)
    _check(ours, ref)


@pytest.mark.parametrize("window", [(-1, -1), (2, 0), (1, 3)], ids=["nowin", "w2_0", "w1_3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_attention_pairs_documents_bottom_right(causal, window):
    """As flash_attn_varlen_func: document i of q attends document i of k, aligned bottom-right."""
    cu_q, cu_k = [0, 3, 3, 8, 9], [0, 5, 7, 9, 13]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(9, 4, 8, generator=g, dtype=F64)
    k, v = (torch.randn(13, 2, 8, generator=g, dtype=F64) for _ in "kv")
    dout, dlse = torch.randn(9, 4, 8, generator=g, dtype=F64), torch.randn(4, 9, generator=g, dtype=F64)

    def ref_fn(q_, k_, v_):
        outs, lses = [], []
        for (qa, qe), (ka, ke) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
            shift = (ke - ka) - (qe - qa)
            o, lse = oracle(q_[None, qa:qe], k_[None, ka:ke], v_[None, ka:ke], range(shift, shift + qe - qa),
                            range(ke - ka), causal, window, None)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    ours = _grads(lambda *t: ringlse.varlen_attention(*t, cu_q, cu_k, causal=causal, window_size=window,
                                                      return_lse=True, backend="torch"), q, k, v, dout, dlse)
    _check(ours, _grads(ref_fn, q, k, v, dout, dlse))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_documents_through_a_backend_without_intervals(causal):
    """The sdpa op (its CPU kernels here) takes no intervals: documents are cut into one plain call per
    document, merged exactly."""
    q, k, v, dout, dlse = _inputs(1, 13, 13, 2, 2, 8, seed=5)
    bounds = DOCS["empty-and-single"]
    ours = _grads(lambda *t: ringlse.attention(*t, causal=causal, cu_seqlens=bounds, return_lse=True,
                                               backend=SDPA_BLOCK_OP), q, k, v, dout, dlse)
    ref = _grads(lambda *t: oracle(*t, range(13), range(13), causal, (-1, -1), bounds), q, k, v, dout, dlse)
    _check(ours, ref)


def test_windows_on_a_backend_without_them_name_the_backends_that_take_them():
    q, k, v, *_ = _inputs(1, 8, 8, 2, 2, 8, seed=6)
    with pytest.raises(ValueError, match=r"window_size needs a backend that takes windows"):
        ringlse.attention(q, k, v, window_size=(2, 2), backend=SDPA_BLOCK_OP)
    with pytest.raises(ValueError, match=r"sdpa does not take windows or documents here \(backends that do: triton, torch"):
        ringlse.get_block_op("sdpa", "cuda", torch.bfloat16, masked=True)
    assert ringlse.get_block_op("auto", "cuda", torch.bfloat16, masked=True).caps.masks is Masks.INTERVALS


def test_the_registry_knows_which_ops_take_intervals():
    from ringlse.blocks import _BACKENDS

    for name, (module, attr, _, intervals) in _BACKENDS.items():
        try:
            op = getattr(importlib.import_module(module), attr)
        except ImportError:  # triton's module needs Triton
            continue
        assert (op.caps.masks is Masks.INTERVALS) == intervals, name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(window_size=(-2, 0)), "window_size left must be an int >= -1"),
        (dict(window_size=(0,)), "window_size must be a pair"),
        (dict(cu_seqlens=[1, 8]), "cu_seqlens must run from 0 to the sequence length 8"),
        (dict(cu_seqlens=[0, 7]), "cu_seqlens must run from 0 to the sequence length 8"),
        (dict(cu_seqlens=[0, 5, 3, 8]), "cu_seqlens must not decrease"),
        (dict(cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens must be a 1-D integer tensor"),
    ],
    ids=["window-below-minus-1", "window-not-a-pair", "docs-not-from-0", "docs-not-to-S", "docs-decrease",
         "docs-float"],
)
def test_bad_masks_raise_naming_the_argument(kwargs, message):
    q, k, v, *_ = _inputs(1, 8, 8, 2, 2, 8, seed=7)
    with pytest.raises(ValueError, match=message):
        ringlse.attention(q, k, v, causal=True, backend="torch", **kwargs)


@st.composite
def _masks(draw):
    s = draw(st.integers(1, 12))
    cuts = sorted(draw(st.lists(st.integers(0, s), max_size=4)))
    window = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6)))
    return s, [0, *cuts, s], window, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(max_examples=40, deadline=None)
@given(_masks())
def test_property_random_documents_and_windows(case):
    s, bounds, window, causal, seed = case
    q, k, v, dout, dlse = _inputs(1, s, s, 2, 1, 4, seed=seed)
    ours = _grads(lambda *t: ringlse.attention(*t, causal=causal, window_size=window, cu_seqlens=bounds,
                                               return_lse=True, backend="torch"), q, k, v, dout, dlse)
    ref = _grads(lambda *t: oracle(*t, range(s), range(s), causal, window, bounds), q, k, v, dout, dlse)
    _check(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)], ids=["fp32", "fp16", "bf16"])
def test_triton_kernels_take_windows_and_documents(dtype, device):
    """The Triton op through the public API (under the interpreter on CPU: fp32/fp16), judged by
    CONVENTIONS.md §7 against the oracle; bf16 runs on the GPU."""
    pytest.importorskip("triton")
    from ringlse.testing import assert_judged, naive_attention

    q, k, v, dout, dlse = _inputs(1, 37, 37, 4, 2, 32, seed=8)
    bounds, window = [0, 5, 5, 6, 30, 37], (9, 2)
    low = [t.to(dtype) for t in (q, k, v)]
    ours = _grads(lambda *t: ringlse.attention(*t, causal=True, window_size=window, cu_seqlens=bounds,
                                               return_lse=True, backend="triton"),
                  *(t.to(device) for t in low), dout.to(device, dtype), dlse.to(device))
    ref = _grads(lambda *t: oracle(*t, range(37), range(37), True, window, bounds), *(t.double() for t in low),
                 dout, dlse)
    base = _grads(lambda *t: naive_attention(*t, causal=True, window_size=window, cu_seqlens=bounds),
                  *low, dout.to(dtype), dlse.to(dtype)) if dtype != torch.float32 else [None] * 5
    for name, a, r, b in zip(("out", "lse", "dq", "dk", "dv"), ours, ref, base):
        assert_judged(name, a.cpu(), r, b, dtype, is_lse=name == "lse")


# blocks of a 30-token packed sequence at global positions, taking the whole sequence's boundaries
GLOBAL_DOCS = [0, 4, 19, 30]
GLOBAL_BLOCKS = [
    pytest.param((15, 12, 0, 10), id="q15x12-k0x10"),  # the block ends at 27, the boundaries at 30
    pytest.param((0, 9, 9, 11), id="q0x9-k9x11"),
    pytest.param((20, 5, 18, 7), id="q20x5-k18x7"),
    pytest.param((3, 1, 0, 4), id="q3x1-k0x4"),
]


@pytest.mark.parametrize("block", GLOBAL_BLOCKS)
@pytest.mark.parametrize("window", [(-1, -1), (3, 0)], ids=["nowindow", "w3_0"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_at_offsets_takes_global_boundaries(block, causal, window):
    """A block at global positions with the packed sequence's boundaries (past the block's end) equals
    the same block cut from full attention with those documents: float64, forward and backward."""
    q_start, sq, k_start, sk = block
    q, k, v, dout, dlse = _inputs(2, sq, sk, 4, 2, 8, seed=sq + sk)
    ours = _grads(lambda *t: ringlse.block_attention(*t, causal=causal, q_start=q_start, k_start=k_start,
                                                     window_size=window, cu_seqlens=GLOBAL_DOCS, backend="torch"),
                  q, k, v, dout, dlse)
    ref = _grads(lambda *t: oracle(*t, range(q_start, q_start + sq), range(k_start, k_start + sk), causal, window,
                                   GLOBAL_DOCS), q, k, v, dout, dlse)
    _check(ours, ref)


def test_block_without_intervals_takes_global_boundaries():
    """A backend without intervals (documents cut into per-document calls) takes them too: the CPU
    `sdpa` op, float64."""
    q, k, v, dout, dlse = _inputs(1, 12, 10, 2, 1, 8, seed=3)
    ours = _grads(lambda *t: ringlse.block_attention(*t, causal=True, q_start=15, k_start=0, cu_seqlens=GLOBAL_DOCS,
                                                     backend=SDPA_BLOCK_OP), q, k, v, dout, dlse)
    ref = _grads(lambda *t: oracle(*t, range(15, 27), range(10), True, (-1, -1), GLOBAL_DOCS), q, k, v, dout, dlse)
    _check(ours, ref)


def test_chunked_attention_takes_boundaries_past_the_keys():
    q, k, v, dout, dlse = _inputs(1, 6, 11, 2, 2, 8, seed=4)
    bounds = [0, 3, 8, 20]
    ours = _grads(lambda *t: ringlse.chunked_attention(*t, causal=True, chunk_size=4, cu_seqlens=bounds,
                                                       return_lse=True, backend="torch"), q, k, v, dout, dlse)
    ref = _grads(lambda *t: oracle(*t, range(5, 11), range(11), True, (-1, -1), bounds), q, k, v, dout, dlse)
    _check(ours, ref)


def test_boundaries_that_stop_inside_the_block_raise():
    q, k, v, *_ = _inputs(1, 12, 10, 2, 1, 8, seed=5)
    with pytest.raises(ValueError, match=r"cu_seqlens must run from 0 to the sequence length 27 or past it"):
        ringlse.block_attention(q, k, v, q_start=15, cu_seqlens=[0, 4, 19, 26], backend="torch")
