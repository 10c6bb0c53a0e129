"""Triton block kernels with interval masks (`key_lo`/`key_hi`, `query_lo`/`query_hi`) against a dense-mask
oracle written here (CONVENTIONS.md §10: causal x sliding window x packed documents).

Every query row of a block sees one interval of keys; the kernels take the bounds, never a mask. The oracle
builds a boolean `[sq, sk]` mask element by element from the rule, runs float64 softmax attention under it
(rows that see nothing: out 0, lse -inf) and differentiates it with autograd. The intervals are computed
here too, independently (closed forms per row), and checked against the dense mask before use.

Two frames of positions:
- global (ring blocks): query `i` of the block sits at `q_start + i`, key `j` at `k_start + j`; one set of
  document boundaries `cu_seqlens` over the whole sequence.
- varlen (`varlen_attention`'s rule): query document `i` attends key document `i`, causal/window aligned
  bottom-right within each pair; q and k documents differ in length (rows that see nothing sit in the
  middle of tiles where a key document is empty, and the keys a query tile sees can have gaps).

Under the interpreter (CPU) only float32 and float16 (its bfloat16 dots are wrong, CONVENTIONS.md §7).
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from ringlse import update_out_and_lse  # noqa: E402
from ringlse.testing import assert_judged  # noqa: E402

fwd_mod = pytest.importorskip("ringlse.kernels.attention_fwd")
bwd_mod = pytest.importorskip("ringlse.kernels.attention_bwd")
from ringlse.kernels.attention_bwd import attention_backward, attention_delta  # noqa: E402
from ringlse.kernels.attention_fwd import attention_forward  # noqa: E402

# the interpreter (CPU) emits a NumPy deprecation warning per scalar conversion
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # interpreter tests on CPU tensors; on a GPU, tests/test_masks_attention.py runs the kernels in bf16
    pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interpreter tests (CPU)"),
]

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------------
# the rule, element by element (the oracle's mask)


def _doc_ids(cu: list[int]) -> torch.Tensor:
    """Document index of every position of `[0, cu[-1])` (empty documents hold no position)."""
    ids = torch.empty(cu[-1], dtype=torch.long)
    for i in range(len(cu) - 1):
        ids[cu[i]:cu[i + 1]] = i
    return ids


def _window_ok(t: torch.Tensor, p: torch.Tensor, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    left, right = window
    ok = torch.ones(torch.broadcast_shapes(t.shape, p.shape), dtype=torch.bool)
    if causal:
        ok &= t <= p
    if left >= 0:
        ok &= t >= p - left
    if right >= 0:
        ok &= t <= p + right
    return ok


def global_mask(sq, sk, q_start, k_start, cu, causal, window) -> torch.Tensor:
    """CONVENTIONS.md §10 at global positions: query at `p` sees key at `t` iff the window rule holds and
    `doc(t) == doc(p)`."""
    doc = _doc_ids(cu)
    p = (q_start + torch.arange(sq))[:, None]
    t = (k_start + torch.arange(sk))[None, :]
    return _window_ok(t, p, causal, window) & (doc[t] == doc[p])


def varlen_mask(cu_q, cu_k, causal, window) -> torch.Tensor:
    """flash-attn varlen: query document `i` attends key document `i`, aligned bottom-right in the pair."""
    dq, dk = _doc_ids(cu_q), _doc_ids(cu_k)
    x = torch.arange(cu_q[-1])[:, None]
    y = torch.arange(cu_k[-1])[None, :]
    cq, ck = torch.tensor(cu_q), torch.tensor(cu_k)
    qlen, klen = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    p = x - cq[dq[x]] + klen[dq[x]] - qlen[dq[x]]  # query's position inside its key document
    t = y - ck[dk[y]]
    return _window_ok(t, p, causal, window) & (dq[x] == dk[y])


# ---------------------------------------------------------------------------------------------------
# the intervals, in closed form (what ringlse.masks computes on the device; here on the host)


def _search(cu: list[int], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(document index, start, end) of the document holding each position of `x`."""
    c = torch.tensor(cu)
    idx = torch.searchsorted(c, x, right=True) - 1
    return idx, c[idx], c[idx + 1]


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def global_intervals(sq, sk, q_start, k_start, cu, causal, window, clamp=True):
    """`(key_lo, key_hi, query_lo, query_hi)`, local to the block; `clamp=False` leaves bounds outside
    `[0, n]` (the kernels clamp them)."""
    left, right = window
    p = q_start + torch.arange(sq)
    _, lo, hi = _search(cu, p)
    if causal:
        hi = torch.minimum(hi, p + 1)
    if left >= 0:
        lo = torch.maximum(lo, p - left)
    if right >= 0:
        hi = torch.minimum(hi, p + right + 1)
    key_lo, key_hi = lo - k_start, hi - k_start
    t = k_start + torch.arange(sk)
    _, lo, hi = _search(cu, t)
    if causal:
        lo = torch.maximum(lo, t)
    if right >= 0:
        lo = torch.maximum(lo, t - right)
    if left >= 0:
        hi = torch.minimum(hi, t + left + 1)
    query_lo, query_hi = lo - q_start, hi - q_start
    if clamp:
        key_lo, key_hi = key_lo.clamp(0, sk), key_hi.clamp(0, sk)
        query_lo, query_hi = query_lo.clamp(0, sq), query_hi.clamp(0, sq)
    return tuple(_i32(t) for t in (key_lo, key_hi, query_lo, query_hi))


def varlen_intervals(cu_q, cu_k, causal, window):
    left, right = window
    cq, ck = torch.tensor(cu_q), torch.tensor(cu_k)
    x = torch.arange(cu_q[-1])
    i, qs, qe = _search(cu_q, x)
    ks, ke = ck[i], ck[i + 1]
    p = x - qs + (ke - ks) - (qe - qs)
    lo, hi = ks.clone(), ke.clone()
    if causal:
        hi = torch.minimum(hi, ks + p + 1)
    if left >= 0:
        lo = torch.maximum(lo, ks + p - left)
    if right >= 0:
        hi = torch.minimum(hi, ks + p + right + 1)
    key_lo, key_hi = lo.clamp(0, cu_k[-1]), hi.clamp(0, cu_k[-1])
    y = torch.arange(cu_k[-1])
    i, ks, ke = _search(cu_k, y)
    qs, qe = cq[i], cq[i + 1]
    t = y - ks
    shift = qs - (ke - ks) + (qe - qs)  # query x sits at p = x - shift
    lo, hi = qs.clone(), qe.clone()
    if causal:
        lo = torch.maximum(lo, t + shift)
    if right >= 0:
        lo = torch.maximum(lo, t - right + shift)
    if left >= 0:
        hi = torch.minimum(hi, t + left + 1 + shift)
    query_lo, query_hi = lo.clamp(0, cu_q[-1]), hi.clamp(0, cu_q[-1])
    return tuple(_i32(t) for t in (key_lo, key_hi, query_lo, query_hi))


def _interval_mask(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:
    j = torch.arange(n)[None, :]
    return (j >= lo.long()[:, None]) & (j < hi.long()[:, None])


def check_intervals_match(mask, iv):
    """The test's own intervals describe exactly the oracle's mask, both ways."""
    key_lo, key_hi, query_lo, query_hi = iv
    sq, sk = mask.shape
    assert torch.equal(_interval_mask(key_lo, key_hi, sk), mask), "key intervals do not match the rule"
    assert torch.equal(_interval_mask(query_lo, query_hi, sq), mask.T), "query intervals do not match the rule"
    live = key_lo < key_hi
    for b in (key_lo[live], key_hi[live]):
        assert (b[1:] >= b[:-1]).all(), "bounds of rows that see keys must be non-decreasing"


# ---------------------------------------------------------------------------------------------------
# the oracle: softmax attention under a dense mask, in any dtype


def dense_attention(q, k, v, mask, scale, dtype):
    """`(out [b, sq, h, d], lse [b, h, sq])` with every operation in `dtype`; rows that see no key give
    out 0, lse -inf, and zero gradients."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    s = s.masked_fill(~mask, NEG_INF)
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    out = torch.einsum("bhij,bjhd->bihd", p / l_safe, v)
    lse = torch.where(l > 0, m + torch.log(l_safe), torch.full_like(l, NEG_INF)).squeeze(-1)
    return out, lse


def oracle_grads(q, k, v, mask, scale, go, gl, dtype):
    """`(out, lse, dq, dk, dv)` of the loss `sum(out * go) + sum(lse * gl)` (finite lse rows)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = dense_attention(q, k, v, mask, scale, dtype)
    loss = (out * go.to(dtype)).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * gl.to(dtype)).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


# ---------------------------------------------------------------------------------------------------
# one case: a block (q, k, v) with its mask and intervals


class Case:
    def __init__(self, mask, iv, split_iv, sk1, b, h, hkv, d, dtype, seed):
        self.mask, self.iv, self.split_iv, self.sk1 = mask, iv, split_iv, sk1
        self.dtype = dtype
        sq, sk = mask.shape
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(b, sq, h, d, generator=g).to(dtype)
        self.k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
        self.v = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
        self.go = torch.randn(b, sq, h, d, generator=g).to(dtype)
        self.gl = torch.randn(b, h, sq, generator=g)
        self.scale = d**-0.5
        self.ref = oracle_grads(self.q, self.k, self.v, mask, self.scale, self.go, self.gl, torch.float64)
        self.base = [None] * 5 if dtype == torch.float32 else oracle_grads(
            self.q, self.k, self.v, mask, self.scale, self.go, self.gl, dtype)


def global_case(sq, sk, q_start, k_start, cu, causal, window, *, h=4, hkv=2, d=32, dtype=torch.float32, b=1,
                seed=0, clamp=True, split=None):
    """A ring block at global positions; the keys split at `split` (default: the middle) for the
    two-block checks, each half with intervals computed at its own `k_start`."""
    mask = global_mask(sq, sk, q_start, k_start, cu, causal, window)
    iv = global_intervals(sq, sk, q_start, k_start, cu, causal, window, clamp)
    check_intervals_match(mask, global_intervals(sq, sk, q_start, k_start, cu, causal, window))
    sk1 = sk // 2 if split is None else split
    halves = []
    for k0, n in ((0, sk1), (sk1, sk - sk1)):
        if n:
            hv = global_intervals(sq, n, q_start, k_start + k0, cu, causal, window, clamp)
            check_intervals_match(mask[:, k0:k0 + n], global_intervals(sq, n, q_start, k_start + k0, cu, causal,
                                                                       window))
            halves.append((k0, n, hv))
    return Case(mask, iv, halves, sk1, b, h, hkv, d, dtype, seed)


def varlen_case(cu_q, cu_k, causal, window, *, h=4, hkv=2, d=32, dtype=torch.float32, seed=0, split=None):
    mask = varlen_mask(cu_q, cu_k, causal, window)
    iv = varlen_intervals(cu_q, cu_k, causal, window)
    check_intervals_match(mask, iv)
    sq, sk = mask.shape
    sk1 = sk // 2 if split is None else split
    key_lo, key_hi, query_lo, query_hi = iv
    halves = []
    for k0, n in ((0, sk1), (sk1, sk - sk1)):
        if n:
            # the caller's clamp of the block's intervals to one key half
            hv = (_i32((key_lo - k0).clamp(0, n)), _i32((key_hi - k0).clamp(0, n)),
                  _i32(query_lo[k0:k0 + n]), _i32(query_hi[k0:k0 + n]))
            check_intervals_match(mask[:, k0:k0 + n], hv)
            halves.append((k0, n, hv))
    return Case(mask, iv, halves, sk1, 1, h, hkv, d, dtype, seed)


# ---------------------------------------------------------------------------------------------------
# the checks


def _check_empty_rows(out, lse, mask):
    empty = ~mask.any(1)
    assert torch.isneginf(lse[:, :, empty]).all(), "rows that see no key must have lse -inf"
    assert not torch.isneginf(lse[:, :, ~empty]).any()
    assert (out[:, empty] == 0).all(), "rows that see no key must have out 0"


def check_forward(c: Case):
    key_lo, key_hi = c.iv[:2]
    out, lse = attention_forward(c.q, c.k, c.v, softmax_scale=c.scale, causal=False, q_start=0, k_start=0,
                                 key_lo=key_lo, key_hi=key_hi)
    assert out.dtype == c.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any() and not torch.isposinf(lse).any()
    _check_empty_rows(out, lse, c.mask)
    assert_judged("out", out, c.ref[0], c.base[0], c.dtype)
    assert_judged("lse", lse, c.ref[1], c.base[1], c.dtype, is_lse=True)
    return out, lse


def check_forward_merge(c: Case):
    """Merge the two key halves into a running state held in views of larger buffers. The state starts
    random: rows with lse -inf and out NaN (weight 0, whatever the out holds), rows with lse -300 (which
    the block's rows must not wipe out where they see no key), ordinary rows."""
    b, sq, h, d = c.q.shape
    pad = 2
    g = torch.Generator().manual_seed(7)
    obuf = torch.full((b, sq + pad, h, d), float("nan"))
    lbuf = torch.full((b, h, sq + pad), float("nan"))
    out_acc, lse_acc = obuf[:, pad:], lbuf[:, :, pad:]
    state_o = torch.randn(b, sq, h, d, generator=g)
    state_l = torch.randn(b, h, sq, generator=g) * 3
    state_l[:, :, 1::3] = -300.0
    state_l[:, :, ::3] = NEG_INF
    out_acc.copy_(state_o)
    lse_acc.copy_(state_l)
    out_acc[:, ::3] = float("nan")  # rows of weight 0
    exp_o, exp_l = update_out_and_lse(state_o.double(), state_l.double(), c.ref[0], c.ref[1])
    base_o = base_l = None
    if c.base[0] is not None:
        base_o, base_l = update_out_and_lse(state_o, state_l, c.base[0], c.base[1].float())
    for k0, n, (key_lo, key_hi, _, _) in c.split_iv:
        ret = attention_forward(c.q, c.k[:, k0:k0 + n], c.v[:, k0:k0 + n], softmax_scale=c.scale, causal=False,
                                q_start=0, k_start=0, out_acc=out_acc, lse_acc=lse_acc, key_lo=key_lo,
                                key_hi=key_hi)
        assert ret[0] is out_acc and ret[1] is lse_acc
    assert not torch.isnan(lse_acc).any() and not torch.isposinf(lse_acc).any() and not torch.isnan(out_acc).any()
    assert torch.equal(torch.isneginf(lse_acc), torch.isneginf(exp_l))
    assert (out_acc.transpose(1, 2)[torch.isneginf(lse_acc)] == 0).all()
    assert_judged("out", out_acc, exp_o, base_o, c.dtype)
    assert_judged("lse", lse_acc, exp_l, base_l, c.dtype, is_lse=True)
    assert torch.isnan(obuf[:, :pad]).all() and torch.isnan(lbuf[:, :, :pad]).all()


def check_backward(c: Case, out, lse):
    """The block-op contract: the global (out, lse) and delta = rowsum(dout * out) - lse_grad; each key
    half adds its share into float32 accumulators (views, random initial values)."""
    delta = attention_delta(c.go, out) - c.gl
    g = torch.Generator().manual_seed(99)
    b, sq, h, d = c.q.shape
    sk, hkv = c.k.shape[1], c.k.shape[2]
    dq_buf = torch.randn(b, sq, h + 1, d, generator=g)
    dk_buf = torch.randn(b, sk + 3, hkv, d, generator=g)
    dv_buf = torch.randn(b, sk, hkv, d, generator=g)
    dq_acc, dk_acc, dv_acc = dq_buf[:, :, 1:], dk_buf[:, 3:], dv_buf
    inits = [t.clone() for t in (dq_acc, dk_acc, dv_acc)]
    for k0, n, (key_lo, key_hi, query_lo, query_hi) in c.split_iv:
        sl = slice(k0, k0 + n)
        attention_backward(c.go, c.q, c.k[:, sl], c.v[:, sl], out, lse, delta, softmax_scale=c.scale,
                           causal=False, q_start=0, k_start=0, dq_acc=dq_acc, dk_acc=dk_acc[:, sl],
                           dv_acc=dv_acc[:, sl], key_lo=key_lo, key_hi=key_hi, query_lo=query_lo,
                           query_hi=query_hi)
    for name, acc, init, r, bl in zip(("dq", "dk", "dv"), (dq_acc, dk_acc, dv_acc), inits, c.ref[2:], c.base[2:]):
        grad = acc - init
        assert not torch.isnan(grad).any(), f"{name} has NaN"
        assert_judged(name, grad, r, bl, c.dtype)
    # exact zeros where the mask leaves nothing: rows that see no key, keys no row sees
    assert (dq_acc[:, ~c.mask.any(1)] == inits[0][:, ~c.mask.any(1)]).all()
    unseen = ~c.mask.any(0)
    assert (dk_acc[:, unseen] == inits[1][:, unseen]).all() and (dv_acc[:, unseen] == inits[2][:, unseen]).all()


def check_all(c: Case):
    out, lse = check_forward(c)
    check_forward_merge(c)
    check_backward(c, out, lse)


# ---------------------------------------------------------------------------------------------------
# named cases (global positions)

# cu_seqlens over a sequence of 300 with empty documents (repeated boundaries) and length-1 documents
DOCS = [0, 7, 7, 8, 40, 41, 42, 42, 90, 91, 150, 150, 151, 230, 231, 300]


@pytest.mark.parametrize(
    "dtype,sq,sk,q_start,k_start,cu,causal,window,hd",
    [
        # documents with empty and length-1 ones, causal, diagonal block
        pytest.param(torch.float32, 97, 97, 20, 20, DOCS, True, (-1, -1), ((4, 2), 32), id="docs-causal-diag-fp32"),
        pytest.param(torch.float16, 130, 64, 100, 60, DOCS, True, (-1, -1), ((4, 2), 80), id="docs-causal-fp16-d80"),
        # documents without causal: both ends masked
        pytest.param(torch.float32, 64, 130, 30, 0, DOCS, False, (-1, -1), ((2, 1), 80), id="docs-bidir-fp32"),
        # window 0: each row sees itself only (where its key is in the block)
        pytest.param(torch.float32, 64, 97, 10, 0, [0, 300], True, (0, 0), ((4, 2), 32), id="window0-fp32"),
        pytest.param(torch.float16, 97, 64, 0, 20, [0, 300], False, (0, 0), ((4, 2), 32), id="window0-bidir-fp16"),
        # windows larger than the block, and smaller than a tile
        pytest.param(torch.float32, 130, 130, 150, 100, [0, 300], True, (200, -1), ((4, 2), 32), id="wide-window-fp32"),
        pytest.param(torch.float16, 97, 130, 60, 20, [0, 300], False, (5, 9), ((4, 2), 80), id="band-5-9-fp16"),
        # window x documents x causal at an offset block
        pytest.param(torch.float32, 130, 97, 120, 60, DOCS, True, (25, -1), ((4, 2), 80), id="docs-window-fp32"),
        # length-1 blocks
        pytest.param(torch.float32, 1, 17, 41, 30, DOCS, False, (3, 3), ((4, 2), 32), id="sq1-fp32"),
        pytest.param(torch.float16, 17, 1, 0, 8, DOCS, False, (-1, -1), ((4, 2), 32), id="sk1-fp16"),
        # every row empty: keys after the queries under causal, and keys of other documents
        pytest.param(torch.float32, 64, 64, 0, 100, [0, 300], True, (-1, -1), ((4, 2), 32), id="all-empty-causal"),
        pytest.param(torch.float16, 17, 64, 42, 100, DOCS, False, (-1, -1), ((4, 2), 32), id="all-empty-docs"),
    ],
)
def test_global_positions(dtype, sq, sk, q_start, k_start, cu, causal, window, hd):
    (h, hkv), d = hd
    c = global_case(sq, sk, q_start, k_start, cu, causal, window, h=h, hkv=hkv, d=d, dtype=dtype, seed=sq + sk)
    check_all(c)


def test_unclamped_bounds():
    """Bounds outside `[0, n]` (e.g. global positions shifted but not clamped) are clamped by the kernels;
    empty rows then have `lo > hi` anywhere."""
    c = global_case(97, 64, 10, 30, DOCS, False, (30, 30), h=2, hkv=1, d=32, seed=5, clamp=False)
    key_lo, key_hi, query_lo, query_hi = c.iv
    assert (key_lo < 0).any() and (key_hi > 64).any() and (query_lo < 0).any() and (query_hi > 97).any()
    check_all(c)


# ---------------------------------------------------------------------------------------------------
# varlen frame: empty rows in the middle of tiles, gaps between the keys of neighbouring rows


@pytest.mark.parametrize(
    "dtype,cu_q,cu_k,causal,window",
    [
        # key document 1 and 3 empty: their query rows (in the middle of tiles) see nothing
        pytest.param(torch.float32, [0, 10, 25, 26, 60, 64], [0, 30, 30, 50, 50, 97], True, (-1, -1),
                     id="empty-key-docs-causal-fp32"),
        pytest.param(torch.float16, [0, 10, 25, 26, 60, 64], [0, 30, 30, 50, 50, 97], False, (-1, -1),
                     id="empty-key-docs-bidir-fp16"),
        # short query documents against long key documents with a window: the keys a query tile sees have
        # gaps (masked tiles in between); empty query documents too
        pytest.param(torch.float32, [0, 3, 3, 9, 12, 17], [0, 40, 45, 80, 81, 130], True, (4, -1),
                     id="gaps-window-fp32"),
        # query documents longer than key documents under causal: leading rows of each see nothing
        pytest.param(torch.float16, [0, 40, 41, 97], [0, 5, 6, 17], True, (-1, -1), id="long-q-docs-fp16"),
    ],
)
def test_varlen(dtype, cu_q, cu_k, causal, window):
    c = varlen_case(cu_q, cu_k, causal, window, dtype=dtype, d=32 if dtype == torch.float16 else 80, seed=3)
    check_all(c)


# ---------------------------------------------------------------------------------------------------
# random masks


def _random_docs(rng: random.Random, total: int) -> list[int]:
    cuts = sorted(rng.randrange(0, total + 1) for _ in range(rng.randrange(0, 8)))
    # force an empty document and a length-1 document somewhere
    x = rng.randrange(0, total)
    cuts += [x, x, x + 1]
    return [0] + sorted(cuts) + [total]


@pytest.mark.parametrize("seed", range(6))
def test_random_global(seed):
    rng = random.Random(1000 + seed)
    sizes = [1, 17, 64, 97, 130]
    sq, sk = rng.choice(sizes), rng.choice(sizes)
    total = 320
    q_start, k_start = rng.randrange(0, total - sq), rng.randrange(0, total - sk)
    if rng.random() < 0.5:  # near the diagonal, where causal and windows cut through the block
        k_start = max(0, min(total - sk, q_start + rng.randrange(-40, 41)))
    causal = rng.random() < 0.6
    window = (rng.choice([-1, 0, 3, 20, 150]), rng.choice([-1, 0, 5, 40]))
    cu = _random_docs(rng, total) if rng.random() < 0.7 else [0, total]
    dtype = torch.float32 if seed % 2 == 0 else torch.float16
    h, hkv = rng.choice([(4, 2), (2, 2), (4, 1)])
    d = rng.choice([32, 80])
    split = rng.randrange(0, sk + 1)
    c = global_case(sq, sk, q_start, k_start, cu, causal, window, h=h, hkv=hkv, d=d, dtype=dtype, seed=seed,
                    split=split)
    check_all(c)


# ---------------------------------------------------------------------------------------------------
# tiles no row sees are never read


def test_skipped_tiles_are_never_read():
    """NaN in the keys/values of key tiles no query row of a program sees, and in the query rows (q, dout)
    of query tiles no key of a program sees, must not reach any result: those tiles are never loaded."""
    from ringlse.kernels.attention_common import bwd_configs, fwd_configs

    sq, sk, d = 97, 130, 32
    # queries at [100, 197), keys at [0, 130), causal window 20 inside documents [0, 130), [130, 300):
    # rows 100..129 see keys [80, 130); rows 130.. (document 2) see no key of this block
    c = global_case(sq, sk, 100, 0, [0, 130, 300], True, (20, -1), h=2, hkv=1, d=d, seed=4)
    fc = fwd_configs(d, torch.float32, True)[0]
    bc = bwd_configs(d, torch.float32, True)[0]
    block_n = min(fc.block_n, bc.q_block_n)
    assert fc.block_n % block_n == 0 and bc.q_block_n % block_n == 0
    seen_keys = c.mask.any(0).nonzero().flatten()
    k_lo = (seen_keys.min().item() // max(fc.block_n, bc.q_block_n)) * max(fc.block_n, bc.q_block_n)
    assert k_lo >= 64, "the case must leave whole key tiles unseen"
    seen_rows = c.mask.any(1).nonzero().flatten()
    m_hi = -(-(seen_rows.max().item() + 1) // bc.kv_block_m) * bc.kv_block_m
    assert m_hi <= sq - 32, "the case must leave whole query tiles unseen"
    # rows that see nothing may hold any empty bounds (lo >= hi), anywhere; they must not widen the walk
    key_lo, key_hi, query_lo, query_hi = (t.clone() for t in c.iv)
    empty_rows = (key_lo >= key_hi).nonzero().flatten()
    assert len(empty_rows) >= 2
    key_lo[empty_rows[::2]], key_hi[empty_rows[::2]] = 0, 0
    key_lo[empty_rows[1::2]], key_hi[empty_rows[1::2]] = sk + 7, -5
    unseen_keys = (query_lo >= query_hi).nonzero().flatten()
    assert len(unseen_keys) >= 2
    query_lo[unseen_keys[::2]], query_hi[unseen_keys[::2]] = sq, sq
    query_lo[unseen_keys[1::2]], query_hi[unseen_keys[1::2]] = sq + 2, -4
    k, v = c.k.clone(), c.v.clone()
    k[:, :k_lo] = float("nan")
    v[:, :k_lo] = float("nan")
    q, go = c.q.clone(), c.go.clone()
    q[:, m_hi:] = float("nan")
    go[:, m_hi:] = float("nan")
    out, lse = attention_forward(q, k, v, softmax_scale=c.scale, causal=False, q_start=0, k_start=0,
                                 key_lo=key_lo, key_hi=key_hi)
    _check_empty_rows(out, lse, c.mask)
    assert_judged("out", out, c.ref[0], None, torch.float32)
    assert_judged("lse", lse, c.ref[1], None, torch.float32, is_lse=True)
    delta = attention_delta(c.go, out) - c.gl  # delta of the clean rows (the NaN rows' delta is unused)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    attention_backward(go, q, k, v, out, lse, delta, softmax_scale=c.scale, causal=False, q_start=0, k_start=0,
                       dq_acc=dq, dk_acc=dk, dv_acc=dv, key_lo=key_lo, key_hi=key_hi, query_lo=query_lo,
                       query_hi=query_hi)
    for name, ours, r in zip(("dq", "dk", "dv"), (dq, dk, dv), c.ref[2:]):
        assert not torch.isnan(ours).any(), f"{name}: a skipped tile was read"
        assert_judged(name, ours, r, None, torch.float32)


# ---------------------------------------------------------------------------------------------------
# argument checks


def test_interval_arguments_checked():
    q = torch.randn(1, 8, 2, 16)
    k = torch.randn(1, 5, 2, 16)
    lo = torch.zeros(8, dtype=torch.int32)
    hi = torch.full((8,), 5, dtype=torch.int32)
    kw = dict(softmax_scale=0.25, q_start=0, k_start=0)
    with pytest.raises(ValueError, match="causal"):
        attention_forward(q, k, k, causal=True, key_lo=lo, key_hi=hi, **kw)
    with pytest.raises(ValueError, match="both"):
        attention_forward(q, k, k, causal=False, key_lo=lo, **kw)
    with pytest.raises(ValueError, match="int32"):
        attention_forward(q, k, k, causal=False, key_lo=lo.long(), key_hi=hi, **kw)
    with pytest.raises(ValueError, match=r"\(8,\)"):
        attention_forward(q, k, k, causal=False, key_lo=lo[:5], key_hi=hi, **kw)
    lse = torch.zeros(1, 2, 8)
    acc = dict(dq_acc=torch.zeros(q.shape), dk_acc=torch.zeros(k.shape), dv_acc=torch.zeros(k.shape))
    qlo = torch.zeros(5, dtype=torch.int32)
    qhi = torch.full((5,), 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="all of"):
        attention_backward(q, q, k, k, q, lse, lse, causal=False, key_lo=lo, key_hi=hi, **acc, **kw)
    with pytest.raises(ValueError, match="causal"):
        attention_backward(q, q, k, k, q, lse, lse, causal=True, key_lo=lo, key_hi=hi, query_lo=qlo,
                           query_hi=qhi, **acc, **kw)
    with pytest.raises(ValueError, match=r"\(5,\)"):
        attention_backward(q, q, k, k, q, lse, lse, causal=False, key_lo=lo, key_hi=hi, query_lo=lo,
                           query_hi=hi, **acc, **kw)


def test_zero_length_with_intervals():
    q = torch.randn(1, 0, 2, 16)
    k = torch.randn(1, 5, 2, 16)
    e = torch.zeros(0, dtype=torch.int32)
    out, lse = attention_forward(q, k, k, softmax_scale=0.25, causal=False, q_start=0, k_start=0, key_lo=e, key_hi=e)
    assert out.shape == q.shape and lse.shape == (1, 2, 0)
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 0, 2, 16)
    lo = torch.zeros(4, dtype=torch.int32)
    out, lse = attention_forward(q, k, k, softmax_scale=0.25, causal=False, q_start=0, k_start=0, key_lo=lo, key_hi=lo)
    assert (out == 0).all() and torch.isneginf(lse).all()
