"""How ringlse decides that a result equals softmax attention (CONVENTIONS.md §7), for tests and users alike.

Low-precision results are judged against what the same math done naively in that precision gets
wrong: `max|ours - ref| <= 2 * max|baseline - ref| + floor`, with `floor` the rounding of the reference
itself in that dtype. Float32 results must be within `1e-3 * max|ref|`; float64 within
`torch.testing.assert_close` defaults.

Error growth with the world size (CONVENTIONS.md §7: the error at W = 4 at most 1.25x the error at W = 1) is
judged on the root mean square error (`Verdict.rms_err`), not the maximum. The maximum error of a bf16
result is about half a unit in the last place of its largest entries, set by the final rounding: any
change in the float32 sums before it moves it in steps. Measured on 4x H200 (ring at W = 4 and W = 1 on
the same inputs, 10 seeds, `benchmarks/results/error_growth-4xH200.json`): the `sdpa` ring's dv max-error
ratio ranged 1.02-1.97 across seeds while its RMS ratio stayed within 1.225-1.246; with GQA its dk max
ratio ranged 0.77-1.32 and the RMS ratio 0.985-1.001.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringlse.reference import attention_math, reference_attention


def random_inputs(b: int, s: int, h: int, hkv: int, d: int, dtype: torch.dtype, seed: int,
                  device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Fresh standard-normal `q [b, s, h, d]`, `k, v [b, s, hkv, d]`, `dout [b, s, h, d]` in `dtype` and
    `dlse [b, h, s]` in float64, drawn in float64 on the CPU from `seed` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, s, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, s, hkv, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64)
    dlse = torch.randn(b, h, s, generator=gen, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)] + [dlse.to(device)]


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_start: int | None = None,
    k_start: int = 0,
    window_size: tuple[int, int] = (-1, -1),
    cu_seqlens=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline of CONVENTIONS.md §7: the reference's attention with every operation in the input
    dtype. Same arguments as `reference_attention`; `(out, lse)` both in q's dtype."""
    return attention_math(q, k, v, causal=causal, softmax_scale=softmax_scale, q_start=q_start, k_start=k_start,
                          window_size=window_size, cu_seqlens=cu_seqlens, dtype=q.dtype)


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """`2 * max|(ref + 0.3 - 0.3) - ref|` with the arithmetic in `dtype`: the error of merely storing
    values of this size in that dtype."""
    r = ref.to(dtype)
    return 2.0 * ((r + 0.3) - 0.3).double().sub(ref.double()).abs().max().item()


@dataclass
class Verdict:
    name: str
    max_err: float
    mean_err: float
    bound: float
    rms_err: float  # root mean square error: what growth with the world size is judged by (module docstring)

    @property
    def ok(self) -> bool:
        return self.max_err <= self.bound

    def __str__(self) -> str:
        mark = "PASS" if self.ok else "FAIL"
        return (f"{self.name:<5} max {self.max_err:.3e}  mean {self.mean_err:.3e}  rms {self.rms_err:.3e}  "
                f"bound {self.bound:.3e}  {mark}")


def _finite_diff(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|ours - ref| with matching infinities (`-inf` lse rows) counted as 0 and NaN as inf."""
    o, r = ours.double(), ref.double()
    same_inf = torch.isinf(o) & torch.isinf(r) & (torch.sign(o) == torch.sign(r))
    diff = torch.where(same_inf, torch.zeros_like(o), (o - r).abs())
    return torch.nan_to_num(diff, nan=float("inf"))


def judge(
    name: str,
    ours: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor | None,
    dtype: torch.dtype,
    *,
    is_lse: bool = False,
) -> Verdict:
    """Compare `ours` with the float64 `ref` by CONVENTIONS.md §7 for inputs of `dtype`.

    `baseline` (the naive in-dtype result) is needed for bf16/fp16 only.
    """
    diff = _finite_diff(ours, ref)
    max_err = diff.max().item() if diff.numel() else 0.0
    mean_err = diff.mean().item() if diff.numel() else 0.0
    rms_err = diff.square().mean().sqrt().item() if diff.numel() else 0.0
    finite_ref = ref.double()[torch.isfinite(ref)]
    ref_max = finite_ref.abs().max().item() if finite_ref.numel() else 0.0
    if dtype == torch.float64:
        bound = 1e-7 + 1e-7 * ref_max  # assert_close's float64 defaults, as an absolute bound
    elif dtype == torch.float32:
        bound = 1e-3 * ref_max
    else:
        if baseline is None:
            raise ValueError(f"judge: {name} in {dtype} needs the naive baseline")
        base_err = _finite_diff(baseline, ref).max().item() if ref.numel() else 0.0
        if is_lse:
            bound = 2 * base_err + 1e-5
        else:
            bound = 2 * base_err + rounding_floor(torch.nan_to_num(ref.double(), neginf=0.0), dtype)
    return Verdict(name, max_err, mean_err, bound, rms_err)


def assert_judged(name, ours, ref, baseline, dtype, *, is_lse: bool = False) -> Verdict:
    """`judge` and raise AssertionError (with the numbers) on failure."""
    v = judge(name, ours, ref, baseline, dtype, is_lse=is_lse)
    assert v.ok, str(v)
    return v


RESULT_NAMES = ("out", "lse", "dq", "dk", "dv")


def attention_with_grads(fn, q, k, v, dout, dlse=None, *, upcast: bool, **kwargs) -> tuple[torch.Tensor, ...]:
    """`(out, lse, dq, dk, dv)` of `fn(q, k, v, **kwargs) -> (out, lse)` for the loss
    `sum(out * dout) [+ sum(lse * dlse)]`; `upcast=True` differentiates float64 copies of q, k, v (the
    reference must not round its results back to the input dtype)."""
    leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, **kwargs)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse.double() * dlse.double()).sum()
    loss.backward()
    return out.detach(), lse.detach(), *(t.grad for t in leaves)


def ring_with_grads(q, k, v, dout, dlse=None, *, causal: bool, layout: str, backend="auto",
                    group=None, non_contiguous: bool = False, return_lse: bool = True,
                    window_size=(-1, -1), cu_seqlens=None) -> tuple[torch.Tensor, ...]:
    """Shard full `q, k, v, dout` (same on every rank), run `ring_attention` forward and backward,
    and gather: the full-sequence `(out, lse, dq, dk, dv)` on every rank.

    With `return_lse=False` (no `dlse` then) the differentiated call returns `out` alone, as most
    training code calls it, and the lse comes from a second, gradient-free call.

    Its many parameters are the call's options, one keyword each, as the public entry points take them.
    """
    from ringlse.ring import ring_attention, shard, unshard

    local = [shard(t, layout, group=group, cu_seqlens=cu_seqlens) for t in (q, k, v, dout)]
    if non_contiguous:  # a [b, h, n, d] storage seen as [b, n, h, d]: strided inputs must work
        local[:3] = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in local[:3]]
    ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
    kw = dict(causal=causal, layout=layout, backend=backend, group=group, window_size=window_size,
              cu_seqlens=cu_seqlens)
    if return_lse:
        out, lse = ring_attention(ql, kl, vl, return_lse=True, **kw)
    else:
        if dlse is not None:
            raise ValueError("ring_with_grads: an lse gradient needs return_lse=True")
        out = ring_attention(ql, kl, vl, **kw)
        with torch.no_grad():
            _, lse = ring_attention(ql, kl, vl, return_lse=True, **kw)
    loss = (out.double() * local[3].double()).sum()
    if dlse is not None:
        loss = loss + (lse.double() * shard(dlse, layout, dim=2, group=group, cu_seqlens=cu_seqlens).double()).sum()
    loss.backward()

    def gather(t, dim=1):
        return unshard(t.detach(), layout, dim=dim, group=group, cu_seqlens=cu_seqlens)

    return gather(out), gather(lse, 2), gather(ql.grad), gather(kl.grad), gather(vl.grad)


def judge_all(ours, q, k, v, dout, dlse=None, *, causal: bool, window_size=(-1, -1), cu_seqlens=None
              ) -> list[Verdict]:
    """Judge full-sequence `(out, lse, dq, dk, dv)` against the float64 reference (and, for bf16/fp16,
    the naive in-dtype baseline) by CONVENTIONS.md §7.

    The references are computed one kv-head group at a time (heads are independent), so the float64
    score matrices of long sequences need `1 / nheads_kv` of the memory.
    """
    kw = dict(causal=causal, q_start=0, k_start=0, window_size=window_size, cu_seqlens=cu_seqlens)
    hkv = k.shape[2]
    g = q.shape[2] // hkv

    def per_group(fn, upcast):
        parts = [attention_with_grads(fn, q[:, :, j * g:(j + 1) * g], k[:, :, j:j + 1], v[:, :, j:j + 1],
                                      dout[:, :, j * g:(j + 1) * g],
                                      None if dlse is None else dlse[:, j * g:(j + 1) * g], upcast=upcast, **kw)
                 for j in range(hkv)]
        return [torch.cat(xs, dim=1 if i == 1 else 2) for i, xs in enumerate(zip(*parts))]

    ref = per_group(reference_attention, True)
    low = q.dtype in (torch.bfloat16, torch.float16)
    base = per_group(naive_attention, False) if low else [None] * 5
    return [judge(n, a, r, b_, q.dtype, is_lse=n == "lse") for n, a, r, b_ in zip(RESULT_NAMES, ours, ref, base)]
