"""Learnable attention sinks (GPT-OSS's `s_aux`, FlashAttention-4's `learnable_sink`): one logit per
query head whose `exp` joins every row's softmax denominator, with no value behind it.

In lse terms a sink is one more state, output 0 and lse `sink[h]`, merged once into a call's finished
state: `lse' = logaddexp(lse, sink)`, `out' = out · exp(lse − lse')`. So sinks work on every backend and
across the ring (each rank adds them to its own rows, once), and the returned lse includes the sink
(FlashAttention-4's convention; CONVENTIONS.md §3). Rows that see no key give `out' = 0`, `lse' = sink`.
"""

from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor, what: str) -> str | None:
    """Why `sinks` cannot serve queries `q` (`[b, s, h, d]`), or None."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        return f"{what}: sinks must be a floating-point tensor [nheads], got {type(sinks).__name__}"
    if sinks.shape != (q.shape[2],):
        return f"{what}: sinks must be one logit per query head, [{q.shape[2]}], got {tuple(sinks.shape)}"
    if sinks.device != q.device:
        return f"{what}: sinks must be on q's device {q.device}, got {sinks.device}"
    return None


def _weights(lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(lse', w, p)`: the merged lse, the weight `exp(lse − lse')` of the attention state and the
    sink's `exp(sink − lse')`, with `w = 0` where lse is -inf and both 0 where the sink is -inf too."""
    s = sinks.to(lse.dtype)[None, :, None].expand_as(lse)
    merged = torch.logaddexp(lse, s)
    finite = torch.isfinite(merged)
    shift = torch.where(finite, merged, torch.zeros_like(merged))
    w = torch.where(finite, torch.exp(lse - shift), torch.zeros_like(lse))
    p = torch.where(finite, torch.exp(s - shift), torch.zeros_like(lse))
    return merged, w, p


class _Sinks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, lse, sinks):
        ctx.set_materialize_grads(False)
        merged, w, p = _weights(lse, sinks)
        ctx.save_for_backward(out, w, p, sinks)
        return (out.to(w.dtype) * w.transpose(1, 2)[..., None]).to(out.dtype), merged

    @staticmethod
    def backward(ctx, g_out, g_lse):
        out, w, p, sinks = ctx.saved_tensors
        acc = w.dtype
        d_out = d_lse = d_sinks = None
        # with u = out·w: du/dlse = out·w·p and du/dsink = −out·w·p; dlse'/dlse = w, dlse'/dsink = p
        coupled = torch.zeros_like(w)
        if g_out is not None:
            d_out = (g_out.to(acc) * w.transpose(1, 2)[..., None]).to(out.dtype)
            coupled = (g_out.to(acc) * out.to(acc)).sum(-1).transpose(1, 2) * w * p
        g_lse = torch.zeros_like(w) if g_lse is None else g_lse.to(acc)
        if ctx.needs_input_grad[1]:
            d_lse = coupled + g_lse * w
        if ctx.needs_input_grad[2]:
            d_sinks = (g_lse * p - coupled).sum((0, 2)).to(sinks.dtype)
        return d_out, d_lse, d_sinks


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out', lse')`: the finished state `out` `[b, s, h, d]`, `lse` `[b, h, s]` with the sinks merged
    in once; differentiable in all three (`sinks` `[h]`, any float dtype, its gradient in its dtype)."""
    if sinks is None:
        return out, lse
    return _Sinks.apply(out, lse, sinks)

