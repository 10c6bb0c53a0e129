"""`sum_parts` / `PartSum` (PyTorch path and the Triton kernel) against an explicit float64 sum."""

from __future__ import annotations

import pytest
import torch

from ringlse.merge import GradPart
from ringlse.merge import MAX_PENDING, PartSum, sum_parts

# (batch, rows, heads, headdim, [(start, length, dtype, scale), ...])
CASES = [
    pytest.param(1, 7, 1, 8, [(0, 7, torch.float32, 1.0)], id="one-whole"),
    pytest.param(2, 97, 3, 80, [(0, 50, torch.float16, 1.0), (40, 57, torch.float32, 0.5), (96, 1, torch.float16, 2.0)],
                 id="overlap-b2-d80"),
    pytest.param(1, 33, 2, 16, [(5, 10, torch.float32, 1.0)], id="gaps-are-zero"),
    pytest.param(3, 64, 4, 32, [(i * 8, 16 if i < 7 else 8, torch.float16, 1.0 + i) for i in range(8)], id="eight"),
]


def _parts(b, h, d, spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [GradPart(start, torch.randn(b, n, h, d, generator=gen).to(dt), scale) for start, n, dt, scale in spec]


def _expected(b, s, h, d, parts):
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    for p in parts:
        out[:, p.start : p.start + p.value.shape[1]] += p.scale * p.value.double()
    return out


@pytest.mark.parametrize("b, s, h, d, spec", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sum_parts_pytorch_path(b, s, h, d, spec, dtype):
    parts = _parts(b, h, d, spec)
    got = sum_parts((b, s, h, d), parts, dtype, "cpu", torch.float32)
    assert got.dtype == dtype and got.shape == (b, s, h, d)
    want = _expected(b, s, h, d, parts)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("b, s, h, d, spec", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sum_parts_kernel(b, s, h, d, spec, dtype):
    """The kernel (compiled on GPU, interpreted on CPU) sums in float32 and rounds once."""
    pytest.importorskip("triton")
    from ringlse.kernels.sum_parts import sum_parts_into

    device = "cuda" if torch.cuda.is_available() else "cpu"
    parts = _parts(b, h, d, spec)
    out = torch.full((b, s, h, d), float("nan"), dtype=dtype, device=device)  # every element is written
    sum_parts_into(out, [(p.start, p.value.to(device), p.scale) for p in parts])
    want = _expected(b, s, h, d, parts)
    # float32 sums of <= 8 terms: a few ulp; bf16: one ulp (2^-7 relative at worst; the
    # interpreter's float32 -> bf16 cast truncates where the GPU rounds to nearest)
    rtol = 1e-6 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(out.cpu().double(), want.to(dtype).double(), rtol=rtol, atol=1e-6)


def test_part_sum_folds_and_keeps_accumulator():
    """More parts than one pass takes, plus an in-place accumulator: still the exact sum."""
    b, s, h, d = 2, 41, 2, 8
    total = PartSum((b, s, h, d), torch.float64, torch.device("cpu"))
    spec = [((3 * i) % 30, 11, torch.float32, 1.0 if i % 3 else 0.25) for i in range(3 * MAX_PENDING)]
    parts = _parts(b, h, d, spec, seed=1)
    for i, p in enumerate(parts):
        total.add(p._replace(start=0), offset=p.start)
        if i == 5:
            total.accumulator()[:, 2:4] += 1.0
    want = _expected(b, s, h, d, parts)
    want[:, 2:4] += 1.0
    got = total.result(torch.float64)
    torch.testing.assert_close(got, want)
    assert total.result(torch.float32).dtype == torch.float32


def test_part_sum_without_parts_is_zero():
    got = PartSum((1, 3, 2, 4), torch.float32, torch.device("cpu")).result(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and not got.any()


def test_part_sum_with_an_accumulator_and_a_full_fold_on_the_kernel(monkeypatch):
    """The kernel path (Triton's interpreter on CPU, compiled on GPU) with more parts than one launch takes:
    seven parts, then an accumulator, then more (the fold then holds nine: it launches twice). This is
    what a packed-documents ring's dk/dv sum met with `fa4` (`sum_parts_into: ... got 9`)."""
    pytest.importorskip("triton")
    import ringlse.merge as merge
    from ringlse.kernel_import import kernel_module

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(merge, "_kernels", lambda name, dev: kernel_module(name))
    b, s, h, d = 1, 40, 2, 8
    total = PartSum((b, s, h, d), torch.float32, device)
    spec = [((3 * i) % 30, 10, torch.float32, 1.0 if i % 3 else 0.5) for i in range(MAX_PENDING + 3)]
    parts = _parts(b, h, d, spec, seed=2)
    for i, p in enumerate(parts):
        total.add(GradPart(0, p.value.to(device), p.scale), offset=p.start)
        if i == MAX_PENDING - 2:
            total.accumulator()[:, 1:3] += 1.0
    want = _expected(b, s, h, d, parts)
    want[:, 1:3] += 1.0
    torch.testing.assert_close(total.result(torch.float32).cpu().double(), want, rtol=1e-5, atol=1e-5)
    # and sum_parts itself with twice a launch's parts
    many = _parts(b, h, d, [(i, 20, torch.float32, 1.0) for i in range(2 * MAX_PENDING + 1)], seed=3)
    got = sum_parts((b, s, h, d), [GradPart(p.start, p.value.to(device)) for p in many], torch.float32, device,
                    torch.float32)
    torch.testing.assert_close(got.cpu().double(), _expected(b, s, h, d, many), rtol=1e-5, atol=1e-5)
