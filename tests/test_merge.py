"""The LSE merge (CONVENTIONS.md §3): `update_out_and_lse` and `merge_attn_states`.

The core property: the per-block `(out, lse)` of ANY partition of the keys, merged in ANY order, is
attention over all keys. Blocks come from `reference_attention` on key slices at their global
positions (`k_start` = slice start, the same `q_start` for every block), so causal partitions produce
parts that are partly or fully masked, and rows that see no key at all.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringlse.merge_states import merge_attn_states, update_out_and_lse
from ringlse.reference import reference_attention
from ringlse.testing import assert_judged

F64 = torch.float64


def rand(*shape, dtype=F64, gen=None) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def lse_to_out(x: torch.Tensor) -> torch.Tensor:
    """`[..., h, s]` -> `[..., s, h, 1]`."""
    return x.transpose(-1, -2).unsqueeze(-1)


def blocks_of_partition(q, k, v, parts, *, causal, q_start, softmax_scale=None):
    """`(out, lse)` of each key slice `[a, b)` at its global position."""
    return [
        reference_attention(
            q, k[:, a:b], v[:, a:b], causal=causal, q_start=q_start, k_start=a, softmax_scale=softmax_scale
        )
        for a, b in parts
    ]


def fold(blocks):
    out = lse = None
    for bo, bl in blocks:
        out, lse = update_out_and_lse(out, lse, bo, bl)
    return out, lse


def expected_merge(outs, lses):
    """Independent stable merge in float64: softmax over the stacked lses (torch's own max shift)."""
    ls = torch.stack([x.double() for x in lses])
    lse = torch.logsumexp(ls, dim=0)
    w = torch.softmax(ls, dim=0).nan_to_num(0.0)  # all -inf rows: softmax gives NaN; their weights are 0
    out = sum(lse_to_out(w[i]) * o.double() for i, o in enumerate(outs))
    return out, lse


def naive_merge(outs, lses):
    """The textbook formula without the max shift: what overflows."""
    e = [torch.exp(x) for x in lses]
    total = sum(e)
    out = sum(lse_to_out(ei) * o.to(ei.dtype) for ei, o in zip(e, outs)) / lse_to_out(total)
    return out, torch.log(total)


# ---------------------------------------------------------------------------------------------------
# infinities and extreme values


def test_neginf_blocks_have_zero_weight():
    gen = torch.Generator().manual_seed(1)
    o1, o2 = rand(2, 5, 3, 8, gen=gen), rand(2, 5, 3, 8, gen=gen)
    l1 = rand(2, 3, 5, gen=gen)
    l2 = torch.full_like(l1, float("-inf"))
    # a -inf block leaves the state as it was, whatever its out holds
    for out, lse in (update_out_and_lse(o1, l1, o2, l2), merge_attn_states([o2, o1], [l2, l1])):
        torch.testing.assert_close(out, o1)
        torch.testing.assert_close(lse, l1)
    out, lse = update_out_and_lse(o2, l2, o1, l1)  # a -inf *state* is replaced by the block
    torch.testing.assert_close(out, o1)
    torch.testing.assert_close(lse, l1)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_all_neginf_rows_give_zero_and_neginf_without_nan(dtype):
    gen = torch.Generator().manual_seed(2)
    n, shape = 3, (2, 6, 4, 8)
    outs = [rand(*shape, gen=gen, dtype=dtype).requires_grad_() for _ in range(n)]
    lses = [rand(2, 4, 6, gen=gen, dtype=dtype) for _ in range(n)]
    for x in lses:
        x[:, :, 2] = float("-inf")  # row 2 saw no key in any block
    lses[0][:, :, 4] = float("-inf")  # row 4 saw none in block 0 only
    lses = [x.requires_grad_() for x in lses]
    g_out = rand(*shape, gen=gen, dtype=dtype)
    g_lse = rand(2, 4, 6, gen=gen, dtype=dtype)
    for out, lse in (merge_attn_states(outs, lses), fold(zip(outs, lses))):
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))
        assert torch.isneginf(lse[:, :, 2]).all() and torch.isfinite(lse[:, :, [0, 1, 3, 4, 5]]).all()
        grads = torch.autograd.grad((out, lse), (*outs, *lses), (g_out.to(out.dtype), g_lse.to(lse.dtype)))
        for g in grads:
            assert torch.isfinite(g).all()
        for g in grads[:n]:
            assert torch.equal(g[:, 2], torch.zeros_like(g[:, 2]))
        for g in grads[n:]:
            assert torch.equal(g[:, :, 2], torch.zeros_like(g[:, :, 2]))
        # block 0's lse is -inf on row 4: it has weight 0 there, so no gradient either
        assert torch.equal(grads[0][:, 4], torch.zeros_like(grads[0][:, 4]))
        assert torch.equal(grads[n][:, :, 4], torch.zeros_like(grads[n][:, :, 4]))


def test_scores_times_100_fp32_naive_overflows_ours_does_not():
    b, sq, sk, h, d = 1, 33, 97, 2, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v = rand(b, sq, h, d, gen=gen), rand(b, sk, h, d, gen=gen), rand(b, sk, h, d, gen=gen)
    scale = 100 * d**-0.5  # scores of a few hundred: exp() overflows float32 (max ~88.7)
    ref_out, ref_lse = reference_attention(q, k, v, softmax_scale=scale)
    parts = [(0, 30), (30, 31), (31, 97)]
    blocks = blocks_of_partition(q.float(), k.float(), v.float(), parts, causal=False, q_start=0, softmax_scale=scale)
    outs, lses = [o for o, _ in blocks], [x for _, x in blocks]
    assert lses[0].dtype == torch.float32 and lses[0].max() > 100
    naive_out, naive_lse = naive_merge(outs, lses)
    assert not torch.isfinite(naive_out).all() and not torch.isfinite(naive_lse).all()  # what we avoid
    for out, lse in (merge_attn_states(outs, lses), fold(blocks)):
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        assert_judged("out", out, ref_out, None, torch.float32)
        assert_judged("lse", lse, ref_lse, None, torch.float32, is_lse=True)
        # the lse of a few hundred keeps float32's relative precision
        assert (lse.double() - ref_lse).abs().max() <= 1e-6 * ref_lse.abs().max()


def test_scores_times_1000_fp64_naive_overflows_ours_exact():
    b, sq, sk, h, d = 2, 17, 40, 3, 16
    gen = torch.Generator().manual_seed(4)
    q, k, v = rand(b, sq, h, d, gen=gen), rand(b, sk, h, d, gen=gen), rand(b, sk, h, d, gen=gen)
    scale = 1000 * d**-0.5  # scores of a few thousand: exp() overflows even float64 (max ~709)
    ref_out, ref_lse = reference_attention(q, k, v, causal=True, softmax_scale=scale, q_start=30)
    blocks = blocks_of_partition(q, k, v, [(20, 40), (0, 7), (7, 20)], causal=True, q_start=30, softmax_scale=scale)
    outs, lses = [o for o, _ in blocks], [x for _, x in blocks]
    naive_out, _ = naive_merge(outs, lses)
    assert not torch.isfinite(naive_out).all()
    for out, lse in (merge_attn_states(outs, lses), fold(blocks)):
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("base", [1e4, -1e4], ids=["plus1e4", "minus1e4"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_lse_of_1e4_neither_overflows_nor_underflows(base, dtype):
    gen = torch.Generator().manual_seed(5)
    outs = [rand(1, 9, 2, 16, gen=gen, dtype=dtype) for _ in range(3)]
    lses = [(base + 3 * rand(1, 2, 9, gen=gen)).to(dtype) for _ in range(3)]
    lses[2][0, 0, :4] = -base if base < 0 else -1e4  # weight exp(-2e4) or exactly comparable: both fine
    exp_out, exp_lse = expected_merge(outs, lses)
    naive_out, _ = naive_merge([o.double() for o in outs], [x.double() for x in lses])
    assert not torch.isfinite(naive_out).all()  # exp(1e4) = inf, exp(-1e4) = 0 -> 0/0
    for out, lse in (merge_attn_states(outs, lses), fold(zip(outs, lses))):
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        if dtype == F64:
            torch.testing.assert_close(out, exp_out)
            torch.testing.assert_close(lse, exp_lse)
        else:
            assert_judged("out", out, exp_out, None, dtype)
            # lse ~ 1e4 in float32 is only good to ~1e-3 absolute: its own rounding
            assert (lse.double() - exp_lse).abs().max() <= 4 * torch.finfo(torch.float32).eps * 1e4


def test_leading_batch_dims():
    gen = torch.Generator().manual_seed(6)
    outs = [rand(2, 3, 7, 4, 8, gen=gen) for _ in range(3)]
    lses = [rand(2, 3, 4, 7, gen=gen) for _ in range(3)]
    lses[1][1, 2, 0, :] = float("-inf")
    exp_out, exp_lse = expected_merge(outs, lses)
    for out, lse in (merge_attn_states(outs, lses), fold(zip(outs, lses))):
        assert out.shape == (2, 3, 7, 4, 8) and lse.shape == (2, 3, 4, 7)
        torch.testing.assert_close(out, exp_out)
        torch.testing.assert_close(lse, exp_lse)
    # no batch dim at all: out [s, h, d], lse [h, s]
    out, lse = merge_attn_states([o[0, 0] for o in outs], [x[0, 0] for x in lses])
    torch.testing.assert_close(out, exp_out[0, 0])
    torch.testing.assert_close(lse, exp_lse[0, 0])


# ---------------------------------------------------------------------------------------------------
# autograd


def _states_with_neginf(n, gen):
    outs = [rand(1, 4, 2, 3, gen=gen).requires_grad_() for _ in range(n)]
    lses = [rand(1, 2, 4, gen=gen) for _ in range(n)]
    lses[0][0, 0, 1] = float("-inf")
    lses[-1][0, 1, :2] = float("-inf")
    # never -inf in every state at once: the merged lse would be -inf and finite differences NaN
    return outs, [x.requires_grad_() for x in lses]


def test_gradcheck_merge_attn_states_with_neginf():
    gen = torch.Generator().manual_seed(7)
    outs, lses = _states_with_neginf(3, gen)
    assert torch.autograd.gradcheck(lambda *t: merge_attn_states(t[:3], t[3:]), (*outs, *lses))


def test_gradcheck_update_out_and_lse_with_neginf():
    gen = torch.Generator().manual_seed(8)
    (o1, o2), (l1, l2) = _states_with_neginf(2, gen)
    assert torch.autograd.gradcheck(update_out_and_lse, (o1, l1, o2, l2))
    # starting a state is the identity on the block (finite lse: an output of -inf defeats finite
    # differences)
    l3 = rand(1, 2, 4, gen=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda o, x: update_out_and_lse(None, None, o, x), (o1, l3))


# ---------------------------------------------------------------------------------------------------
# dtypes, purity, errors


@pytest.mark.parametrize(
    ("dtype", "acc"),
    [
        pytest.param(torch.bfloat16, torch.float32, id="bf16"),
        pytest.param(torch.float16, torch.float32, id="fp16"),
        pytest.param(torch.float32, torch.float32, id="fp32"),
        pytest.param(F64, F64, id="fp64"),
    ],
)
def test_dtype_rules(dtype, acc):
    gen = torch.Generator().manual_seed(9)
    outs = [rand(2, 5, 4, 16, gen=gen, dtype=dtype) for _ in range(3)]
    lses = [rand(2, 4, 5, gen=gen, dtype=acc) for _ in range(3)]
    exp_out, exp_lse = expected_merge(outs, lses)

    # update_out_and_lse: the running state is float32 (float64 for float64), from the first block on
    out, lse = update_out_and_lse(None, None, outs[0], lses[0])
    assert out.dtype == acc and lse.dtype == acc
    for o, x in zip(outs[1:], lses[1:]):
        out, lse = update_out_and_lse(out, lse, o, x)
        assert out.dtype == acc and lse.dtype == acc
    # merge_attn_states: out in the dtype of outs[0], lse float32 (float64 for float64)
    m_out, m_lse = merge_attn_states(outs, lses)
    assert m_out.dtype == dtype and m_lse.dtype == acc

    if dtype in (torch.float32, F64):
        for o, x in ((out, lse), (m_out, m_lse)):
            assert_judged("out", o, exp_out, None, dtype)
            assert_judged("lse", x, exp_lse, None, dtype, is_lse=True)
    else:
        # the blocks are exact in this dtype, so the baseline is the float64 merge rounded to it
        baseline = exp_out.to(dtype)
        assert_judged("out", m_out, exp_out, baseline, dtype)
        assert_judged("out", out, exp_out, baseline, dtype)
        torch.testing.assert_close(lse.double(), exp_lse)


def test_inputs_are_not_modified():
    gen = torch.Generator().manual_seed(10)
    o1, o2 = rand(1, 5, 2, 8, gen=gen, dtype=torch.float32), rand(1, 5, 2, 8, gen=gen, dtype=torch.bfloat16)
    l1, l2 = rand(1, 2, 5, gen=gen, dtype=torch.float32), rand(1, 2, 5, gen=gen, dtype=torch.float32)
    copies = [t.clone() for t in (o1, o2, l1, l2)]
    out, lse = update_out_and_lse(o1, l1, o2, l2)
    merge_attn_states([o1, o2], [l1, l2])
    for t, c in zip((o1, o2, l1, l2), copies):
        assert torch.equal(t, c)
    assert out.data_ptr() != o1.data_ptr() and lse.data_ptr() != l1.data_ptr()


def test_update_errors():
    o = torch.randn(1, 5, 2, 8)
    lse = torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match="lse must have shape"):
        update_out_and_lse(None, None, o, torch.randn(1, 5, 2))  # [b, s, h] instead of [b, h, s]
    with pytest.raises(ValueError, match="out must be"):
        update_out_and_lse(None, None, torch.randn(5, 8), torch.randn(5))
    with pytest.raises(ValueError, match="out is None but lse is not"):
        update_out_and_lse(None, lse, o, lse)
    with pytest.raises(ValueError, match="lse is None but out is not"):
        update_out_and_lse(o, None, o, lse)
    with pytest.raises(ValueError, match="differ"):
        update_out_and_lse(torch.randn(1, 6, 2, 8), torch.randn(1, 2, 6), o, lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        update_out_and_lse(o, torch.randn(1, 2, 6), o, lse)


def test_merge_attn_states_errors():
    o = torch.randn(1, 5, 2, 8)
    lse = torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match="as many lses as outs"):
        merge_attn_states([], [])
    with pytest.raises(ValueError, match="as many lses as outs"):
        merge_attn_states([o, o], [lse])
    with pytest.raises(ValueError, match="state 1"):
        merge_attn_states([o, torch.randn(1, 5, 2, 4)], [lse, lse])
    with pytest.raises(ValueError, match="lse must have shape"):
        merge_attn_states([o, o], [lse, torch.randn(1, 5, 2)])


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_started_state_is_a_copy_so_inplace_updates_leave_blocks_alone(dtype):
    # a state started from a float32/float64 block must not alias it: updating that state in place
    # would otherwise overwrite the caller's first block (e.g. an output autograd saved)
    gen = torch.Generator().manual_seed(11)
    outs = [rand(1, 9, 2, 16, gen=gen, dtype=dtype) for _ in range(3)]
    lses = [rand(1, 2, 9, gen=gen, dtype=dtype) for _ in range(3)]
    copies = [t.clone() for t in (*outs, *lses)]
    out, lse = update_out_and_lse(None, None, outs[0], lses[0])
    assert out.data_ptr() != outs[0].data_ptr() and lse.data_ptr() != lses[0].data_ptr()
    for o, x in zip(outs[1:], lses[1:]):
        res = update_out_and_lse(out, lse, o, x, inplace=True)
        assert res[0] is out and res[1] is lse
    for t, c in zip((*outs, *lses), copies):
        assert torch.equal(t, c)
    exp_out, exp_lse = expected_merge(outs, lses)
    if dtype == F64:
        torch.testing.assert_close(out, exp_out)
        torch.testing.assert_close(lse, exp_lse)
    else:
        assert_judged("out", out, exp_out, None, dtype)
        assert_judged("lse", lse, exp_lse, None, dtype, is_lse=True)


# ---------------------------------------------------------------------------------------------------
# the core property (last: the most expensive tests)


@st.composite
def partition_case(draw):
    b = draw(st.integers(1, 2))
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3]))
    d = draw(st.sampled_from([4, 16, 80]))
    sq = draw(st.sampled_from([1, 7, 33, 97]))
    sk = draw(st.sampled_from([1, 2, 9, 40, 97]))
    causal = draw(st.booleans())
    # from "every query row precedes every key" through bottom-right to "every row sees every key"
    q_start = draw(st.integers(-3, sk + 3))
    cuts = sorted(draw(st.lists(st.integers(0, sk), max_size=6)))  # repeated cuts make empty parts
    bounds = [0, *cuts, sk]
    parts = list(zip(bounds[:-1], bounds[1:]))
    order = draw(st.permutations(range(len(parts))))
    seed = draw(st.integers(0, 2**31 - 1))
    return (b, sq, sk, hkv * group, hkv, d), causal, q_start, [parts[i] for i in order], seed


@settings(max_examples=60, deadline=None)
@given(partition_case())
def test_any_partition_any_order_equals_reference(case):
    (b, sq, sk, h, hkv, d), causal, q_start, parts, seed = case
    gen = torch.Generator().manual_seed(seed)
    q, k, v = rand(b, sq, h, d, gen=gen), rand(b, sk, hkv, d, gen=gen), rand(b, sk, hkv, d, gen=gen)
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal, q_start=q_start, k_start=0)
    blocks = blocks_of_partition(q, k, v, parts, causal=causal, q_start=q_start)

    out, lse = fold(blocks)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)

    out, lse = merge_attn_states([o for o, _ in blocks], [x for _, x in blocks])
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


PARTITIONS = [
    # (sq, sk, q_start, parts in merge order)
    pytest.param(33, 97, 64, [(0, 97)], id="one-part"),
    pytest.param(33, 97, 64, [(50, 97), (0, 0), (0, 50), (97, 97)], id="empty-parts"),
    # q_start=0: keys >= 33 are masked for every row, so the last part is fully masked (lse -inf)
    pytest.param(33, 97, 0, [(40, 97), (0, 20), (20, 40)], id="fully-masked-part"),
    # q_start=-10: rows 0..9 see nothing in any part, so the merge must give (0, -inf) there
    pytest.param(33, 40, -10, [(0, 1), (1, 2), (2, 3), (3, 40)], id="empty-rows"),
    pytest.param(97, 97, 0, [(i, i + 1) for i in range(96, -1, -1)], id="97-single-keys-reversed"),
]


@pytest.mark.parametrize(("sq", "sk", "q_start", "parts"), PARTITIONS)
def test_named_partitions_values_and_gradients(sq, sk, q_start, parts):
    """Values and gradients: blocks merged with either function backpropagate exactly like the
    reference on all keys (the lse gradient of a block enters its weight)."""
    b, h, hkv, d = 1, 6, 2, 80
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    q, k, v = (rand(*s, gen=gen).requires_grad_() for s in [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d)])
    g_out, g_lse = rand(b, sq, h, d, gen=gen), rand(b, h, sq, gen=gen)
    ref = reference_attention(q, k, v, causal=True, q_start=q_start)
    ref_grads = torch.autograd.grad(ref, (q, k, v), (g_out, g_lse))
    for merge in (fold, lambda bl: merge_attn_states([o for o, _ in bl], [x for _, x in bl])):
        blocks = blocks_of_partition(q, k, v, parts, causal=True, q_start=q_start)
        out, lse = merge(blocks)
        torch.testing.assert_close(out, ref[0])
        torch.testing.assert_close(lse, ref[1])
        grads = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
        for name, g, rg in zip("qkv", grads, ref_grads):
            assert torch.isfinite(g).all(), name
            torch.testing.assert_close(g, rg, msg=lambda m, name=name: f"d{name}: {m}")
