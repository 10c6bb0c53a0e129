"""`merge_parts` / `StateMerge` (PyTorch path and the Triton kernel) against an explicit float64 merge."""

from __future__ import annotations

import math

import pytest
import torch

from ringlse.merge import StatePart
from ringlse.merge import MAX_PENDING, StateMerge, merge_parts

# (batch, rows, heads, headdim, [(start, length, out dtype), ...])
CASES = [
    pytest.param(1, 7, 1, 8, [(0, 7, torch.float32)], id="one-whole"),
    pytest.param(2, 97, 3, 80, [(0, 50, torch.float16), (40, 57, torch.float32), (96, 1, torch.float16)],
                 id="overlap-b2-d80"),
    pytest.param(1, 33, 2, 16, [(5, 10, torch.float32)], id="gaps-are-empty"),
    pytest.param(3, 64, 4, 32, [(i * 8, 16 if i < 7 else 8, torch.float16) for i in range(8)], id="eight"),
    pytest.param(1, 1, 2, 8, [(0, 1, torch.float32), (0, 1, torch.float16)], id="one-row"),
]


def _parts(b, h, d, spec, seed=0, lse_scale=3.0):
    """Random states; every third part has a few -inf rows (blocks whose rows saw no key)."""
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for i, (start, n, dt) in enumerate(spec):
        lse = lse_scale * torch.randn(b, h, n, generator=gen)
        if i % 3 == 2:
            lse[:, :, ::2] = float("-inf")
        parts.append(StatePart(start, torch.randn(b, n, h, d, generator=gen).to(dt), lse))
    return parts


def _expected(b, s, h, d, parts):
    """Merge in float64 (CONVENTIONS.md §3): rows no part covers, or covered only by -inf, are (0, -inf)."""
    lses = torch.full((len(parts), b, h, s), float("-inf"), dtype=torch.float64)
    outs = torch.zeros(len(parts), b, s, h, d, dtype=torch.float64)
    for i, p in enumerate(parts):
        rows = slice(p.start, p.start + p.out.shape[1])
        lses[i, :, :, rows] = p.lse.double()
        outs[i, :, rows] = p.out.double()
    lse = torch.logsumexp(lses, dim=0)
    w = torch.where(torch.isneginf(lses), 0.0, torch.exp(lses - torch.where(torch.isneginf(lse), 0.0, lse)))
    out = (w.permute(0, 1, 3, 2)[..., None] * outs).sum(0)
    return out, lse


def _check(got, want, out_dtype):
    out, lse = got
    want_out, want_lse = want
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(want_lse)), "-inf rows differ"
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.cpu().double()[finite], want_lse[finite], rtol=1e-6, atol=1e-5)
    # float32 merges of <= 8 terms: a few ulp; half dtypes: one ulp of the result (2^-7 relative for
    # bf16; the interpreter's float32 -> bf16 cast truncates where the GPU rounds to nearest)
    rtol = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[out_dtype]
    torch.testing.assert_close(out.cpu().double(), want_out.to(out_dtype).double(), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("b, s, h, d, spec", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_merge_parts_pytorch_path(b, s, h, d, spec, dtype):
    parts = _parts(b, h, d, spec)
    got = merge_parts((b, s, h, d), parts, dtype, "cpu", torch.float32)
    assert got[0].dtype == dtype and got[0].shape == (b, s, h, d) and got[1].shape == (b, h, s)
    _check(got, _expected(b, s, h, d, parts), dtype)


@pytest.mark.parametrize("b, s, h, d, spec", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merge_parts_kernel(b, s, h, d, spec, dtype):
    """The kernel (compiled on GPU, interpreted on CPU) merges in float32 and rounds once."""
    pytest.importorskip("triton")
    from ringlse.kernels.merge_parts import merge_parts_into

    device = "cuda" if torch.cuda.is_available() else "cpu"
    parts = _parts(b, h, d, spec)
    out = torch.full((b, s, h, d), float("nan"), dtype=dtype, device=device)  # every element is written
    lse = torch.full((b, h, s), float("nan"), device=device)
    merge_parts_into(out, lse, [(p.start, p.out.to(device), p.lse.to(device)) for p in parts])
    _check((out, lse), _expected(b, s, h, d, parts), dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_merge_parts_large_lse_and_empty_rows(device):
    """lse values of +-1e4 stay finite; rows every part calls empty come out exactly (0, -inf)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    b, s, h, d = 1, 40, 2, 64
    parts = _parts(b, h, d, [(0, 40, torch.float32), (10, 30, torch.float32)], seed=3, lse_scale=1e4)
    for p in parts:
        p.lse[:, :, 12 - p.start : 15 - p.start] = float("-inf")  # global rows 12-14
    out, lse = merge_parts((b, s, h, d), [StatePart(p.start, p.out.to(device), p.lse.to(device)) for p in parts],
                           torch.float32, device, torch.float32)
    assert torch.isneginf(lse[:, :, 12:15]).all() and (out[:, 12:15] == 0).all()
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    _check((out, lse), _expected(b, s, h, d, parts), torch.float32)


def test_state_merge_folds():
    """More parts than one pass takes: folded into a float32 state, still the exact merge."""
    b, s, h, d = 2, 41, 2, 8
    total = StateMerge((b, s, h, d), torch.float64, torch.device("cpu"))
    spec = [((3 * i) % 30, 11, torch.float64) for i in range(3 * MAX_PENDING)]
    parts = [p._replace(lse=p.lse.double()) for p in _parts(b, h, d, spec, seed=1)]
    for p in parts:
        total.add(p._replace(start=0), offset=p.start)
    out, lse = total.result(torch.float64)
    want_out, want_lse = _expected(b, s, h, d, parts)
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(out, want_out)


def test_lone_whole_part_is_returned_as_it_is():
    p = StatePart(0, torch.randn(1, 5, 2, 4), torch.randn(1, 2, 5))
    out, lse = merge_parts((1, 5, 2, 4), [p], torch.float32, "cpu", torch.float32)
    assert out is p.out and lse is p.lse


def test_no_parts_is_empty_state():
    out, lse = StateMerge((1, 3, 2, 4), torch.float32, torch.device("cpu")).result(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and (out == 0).all() and torch.isneginf(lse).all()
    assert not math.isnan(out.float().sum().item())


def test_merge_parts_with_more_parts_than_a_launch_takes(monkeypatch):
    """The kernel path (interpreter on CPU, compiled on GPU) with 2 x MAX_PENDING + 1 parts: merged in
    launches of MAX_PENDING through a float32 state, exactly as one merge."""
    pytest.importorskip("triton")
    import ringlse.merge as merge
    from ringlse.kernel_import import kernel_module

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(merge, "_kernels", lambda name, dev: kernel_module(name))
    b, s, h, d = 1, 30, 2, 8
    parts = _parts(b, h, d, [(i, 12, torch.float32) for i in range(2 * MAX_PENDING + 1)], seed=5)
    got = merge_parts((b, s, h, d), [StatePart(p.start, p.out.to(device), p.lse.to(device)) for p in parts],
                      torch.float32, device, torch.float32)
    _check([t.cpu() for t in got], _expected(b, s, h, d, parts), torch.float32)
