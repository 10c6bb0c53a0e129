"""`ringlse.blocks.fa4_replay`: FlashAttention-4's calls replayed from a recorded plan.

On CPU, over stand-in interface functions shaped like FA4's: Python that checks its arguments,
allocates (`empty*`, `zeros*`), takes views, and calls "compiled" kernels fetched from `compile_cache`s
(here float64 PyTorch that writes its outputs, run with the recorder out of the way as C would be).
Every replayed result is compared with the same function run directly on the same inputs. The real FA4
is checked against its own path on GPU in `test_fa4_gpu.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from ringlse.blocks.fa4_replay import Replayed

F64 = torch.float64


class Aux(NamedTuple):
    tensors: object
    scalars: object


class Counting(dict):
    """A `compile_cache`: key -> kernel, counting the lookups (the wrapper's way to its kernels)."""

    lookups = 0

    def __getitem__(self, key):
        Counting.lookups += 1
        return super().__getitem__(key)


def _attend(q, k, v, out, lse_t, scale, aux):
    """A "kernel": attention of `q [b, s, h, d]` over `k`, `v`; writes `out` and `lse_t` (`[b, s, h]`)."""
    assert isinstance(aux, Aux) and aux.tensors is None
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    lse = s.logsumexp(-1)
    out.copy_(torch.einsum("bhij,bjhd->bihd", (s - lse[..., None]).exp(), v))
    lse_t.copy_(lse.transpose(1, 2))


def _accumulate(acc, x, *, weight):
    """A "kernel" that adds into its float64 accumulator (which must start at zero)."""
    acc.add_(x * weight)


def _convert(acc, out):
    out.copy_(acc)


def fake_fwd(q, k, v, softmax_scale=None, return_lse=False, inplace_op=False, copy_q=False):
    """FA4's `_flash_attn_fwd` in shape: checks, `empty` outputs, a transposed lse view to the kernel."""
    assert q.dim() == 4 and q.shape[-1] == k.shape[-1]
    b, s, h, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    key = (q.dtype, q.shape[-1])
    if key not in fake_fwd.compile_cache:
        fake_fwd.compile_cache[key] = _attend
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, dtype=F64, device=q.device)
    if inplace_op:
        out.zero_()
    q_call = q.contiguous() if copy_q else q.detach()
    fake_fwd.compile_cache[key](q_call, k.detach(), v.detach(), out, lse.transpose(1, 2), scale, Aux(None, None))
    return out, (lse if return_lse else None), None


def fake_bwd(x, w=2.0):
    """Two kernels through two caches, with a zeroed float64 accumulator between them."""
    acc = torch.zeros(x.shape, dtype=F64, device=x.device)
    y = torch.empty_like(x)
    if "acc" not in fake_bwd.compile_cache:
        fake_bwd.compile_cache["acc"] = _accumulate
        fake_post.compile_cache["conv"] = _convert
    fake_bwd.compile_cache["acc"](acc, x, weight=w)
    fake_bwd.compile_cache["acc"](acc, x, weight=w)
    fake_post.compile_cache["conv"](acc, y)
    return y, acc


def fake_post():
    """Holds the convert kernel's cache, as FA4's `_bwd_postprocess_convert` does."""


@pytest.fixture(autouse=True)
def fresh_caches():
    for f in (fake_fwd, fake_bwd, fake_post):
        f.compile_cache = Counting()
    Counting.lookups = 0


def _qkv(b=2, s=7, h=3, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g, dtype=F64) for _ in range(3)]


def test_replay_equals_the_function_from_the_third_call():
    rep = Replayed(fake_fwd, [fake_fwd])
    for seed in range(5):
        q, k, v = _qkv(seed=seed)
        got = rep(q, k, v, softmax_scale=0.4, return_lse=True)
        want = fake_fwd(q, k, v, softmax_scale=0.4, return_lse=True)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        assert got[2] is None and got[1].shape == (2, 3, 7)
    plans = list(rep.plans.values())
    assert len(plans) == 1 and plans[0] is not None and not isinstance(plans[0], int)
    # the plan keeps the two outputs, no other allocation (`q.detach()` etc. are views of the inputs)
    assert [a.zeroed for a in plans[0].allocs] == [False, False]


def test_a_replay_calls_the_kernels_and_nothing_else(monkeypatch):
    rep = Replayed(fake_fwd, [fake_fwd])
    q, k, v = _qkv()
    rep(q, k, v)
    rep(q, k, v)
    lookups = Counting.lookups
    monkeypatch.setattr(fake_fwd, "__code__", (lambda *a, **kw: 1 / 0).__code__)  # the wrapper is not run again
    out = rep(q, k, v)[0]
    assert Counting.lookups == lookups  # the kernel is called directly, not looked up
    torch.testing.assert_close(out, _reference(q, k, v), rtol=1e-12, atol=1e-12)


def _reference(q, k, v):
    s = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


def test_each_signature_has_its_own_plan():
    rep = Replayed(fake_fwd, [fake_fwd])
    cases = [dict(shape=(2, 7, 3, 5), scale=0.4), dict(shape=(1, 97, 2, 8), scale=0.4),
             dict(shape=(2, 7, 3, 5), scale=0.1)]
    for _ in range(3):
        for case in cases:
            g = torch.Generator().manual_seed(len(rep.plans))
            q, k, v = (torch.randn(*case["shape"], generator=g, dtype=F64) for _ in range(3))
            got = rep(q, k, v, softmax_scale=case["scale"], return_lse=True)
            want = fake_fwd(q, k, v, softmax_scale=case["scale"], return_lse=True)
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert len(rep.plans) == 3
    # return_lse changes the result's structure: a signature of its own
    q, k, v = _qkv()
    for _ in range(3):
        assert rep(q, k, v, softmax_scale=0.4)[1] is None


def test_inputs_sharing_memory_and_strided_views():
    """K and V packed in one buffer (as the ring's K/V messages are), Q a strided view: the replay reads
    each at its own offset in this call's buffer."""
    rep = Replayed(fake_fwd, [fake_fwd])
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        kv = torch.randn(2, 7, 2, 3, 5, generator=g, dtype=F64)
        q = torch.randn(2, 3, 7, 5, generator=g, dtype=F64).transpose(1, 2)
        k, v = kv[:, :, 0], kv[:, :, 1]
        got = rep(q, k, v)[0]
        torch.testing.assert_close(got, fake_fwd(q, k, v)[0], rtol=0, atol=0)
    # the same shapes from separate buffers: another signature, still right
    q, k, v = _qkv()
    for _ in range(3):
        torch.testing.assert_close(rep(q, k, v)[0], _reference(q, k, v), rtol=1e-12, atol=1e-12)
    assert len(rep.plans) == 2


def test_zeroed_allocations_stay_zeroed_and_several_caches_are_recorded():
    rep = Replayed(fake_bwd, [fake_bwd, fake_post])
    for seed in range(4):
        x = torch.randn(3, 97, generator=torch.Generator().manual_seed(seed), dtype=F64)
        y, acc = rep(x, w=0.5)
        torch.testing.assert_close(y, x, rtol=0, atol=0)
        torch.testing.assert_close(acc, x, rtol=0, atol=0)
    (plan,) = rep.plans.values()
    assert [a.zeroed for a in plan.allocs] == [True, False] and len(plan.calls) == 3


@pytest.mark.parametrize("why", ["inplace_op", "copy_q"])
def test_a_call_that_computes_or_writes_keeps_the_functions_path(why):
    """An operation that writes into a tensor (`out.zero_()`), or a kernel argument made by computing
    (`contiguous()` copying a strided Q), leaves the signature on the function's own path."""
    rep = Replayed(fake_fwd, [fake_fwd])
    for seed in range(4):
        q, k, v = _qkv(seed=seed)
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided: contiguous() copies
        got = rep(q, k, v, **{why: True})
        torch.testing.assert_close(got[0], _reference(q, k, v), rtol=1e-12, atol=1e-12)
    assert list(rep.plans.values()) == [None]


def test_grad_mode_and_requires_grad_are_in_the_signature():
    rep = Replayed(fake_fwd, [fake_fwd])
    q, k, v = _qkv()
    for _ in range(3):
        rep(q, k, v)
        rep(q.requires_grad_(), k, v)
        with torch.no_grad():
            rep(q, k, v)
        q = q.detach()
    assert len(rep.plans) == 3


def test_arguments_it_cannot_key_take_the_functions_path():
    rep = Replayed(fake_fwd, [fake_fwd])
    q, k, v = _qkv()
    for _ in range(3):
        out = rep(q, k, v, softmax_scale=0.3, return_lse=[1])[0]  # a list: not keyed
    assert not rep.plans
    torch.testing.assert_close(out, fake_fwd(q, k, v, softmax_scale=0.3)[0], rtol=0, atol=0)


def _compiled(cache, key, kernel) -> None:
    """A first call's compile, as FA4 does it (`in`, then item assignment)."""
    if key not in cache:
        cache[key] = kernel


def _reads_a_value(x):
    acc = torch.zeros(x.shape, dtype=F64)
    scale = float(x.abs().max())  # a value to the host: a plan would keep the first call's
    _compiled(fake_bwd.compile_cache, "acc", _accumulate)
    fake_bwd.compile_cache["acc"](acc, x, weight=1 / scale)
    return acc


def _adds_in_place(x):
    acc = torch.zeros(x.shape, dtype=F64)
    acc += 1.0
    _compiled(fake_bwd.compile_cache, "acc", _accumulate)
    fake_bwd.compile_cache["acc"](acc, x, weight=1.0)
    return acc


def _aten_in_place(x):
    acc = torch.empty(x.shape, dtype=F64)
    torch.ops.aten.fill_.Scalar(acc, 1.0)
    _compiled(fake_bwd.compile_cache, "acc", _accumulate)
    fake_bwd.compile_cache["acc"](acc, x, weight=1.0)
    return acc


@pytest.mark.parametrize("fn,want", [(_reads_a_value, lambda x: x / x.abs().max()), (_adds_in_place, lambda x: x + 1),
                                     (_aten_in_place, lambda x: x + 1)], ids=["item", "iadd", "aten-fill_"])
def test_values_read_to_the_host_and_other_writes_keep_the_functions_path(fn, want):
    rep = Replayed(fn, [fake_bwd])
    for seed in range(4):
        x = torch.randn(5, 33, generator=torch.Generator().manual_seed(seed), dtype=F64)
        torch.testing.assert_close(rep(x), want(x), rtol=1e-15, atol=1e-15)
    assert list(rep.plans.values()) == [None]


def _through_get(x):
    y = torch.empty_like(x)
    _compiled(fake_post.compile_cache, "conv", _convert)
    fake_post.compile_cache.get("conv")(x, y)
    return y


def _through_values(x):
    y = torch.empty_like(x)
    _compiled(fake_post.compile_cache, "conv", _convert)
    next(iter(fake_post.compile_cache.values()))(x, y)  # a kernel reached past the cache's lookups
    return y


@pytest.mark.parametrize("fn,replays", [(_through_get, True), (_through_values, False)], ids=["get", "values"])
def test_kernels_reached_past_the_lookups_keep_the_functions_path(fn, replays):
    """`cache.get(key)` is logged like `cache[key]`; any other way into the cache leaves no plan (its kernel
    would not be replayed, and its output would stay unwritten)."""
    rep = Replayed(fn, [fake_post])
    for seed in range(4):
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed), dtype=F64)
        torch.testing.assert_close(rep(x), x, rtol=0, atol=0)
    (plan,) = rep.plans.values()
    assert (plan is not None) == replays


def _asks_the_size(x):
    y = torch.empty_like(x)
    _compiled(fake_post.compile_cache, "conv", _convert)
    assert len(fake_post.compile_cache) >= 1  # the spy takes no len(): a TypeError while recorded
    fake_post.compile_cache["conv"](x, y)
    return y


def test_a_call_that_fails_only_while_recorded_runs_again_unrecorded():
    """The recorder must not change what the function does: a call that raises under the spies is run again
    on its own and returns its result (no plan); the function's own errors still reach the caller."""
    rep = Replayed(_asks_the_size, [fake_post])
    for seed in range(4):
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(seed), dtype=F64)
        torch.testing.assert_close(rep(x), x, rtol=0, atol=0)
    assert list(rep.plans.values()) == [None]
    rep = Replayed(fake_fwd, [fake_fwd])
    q, k, v = _qkv()
    for _ in range(3):
        with pytest.raises(AssertionError):
            rep(q, k[..., :4], v)  # head dims that differ: fake_fwd's own check
