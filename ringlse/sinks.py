"""Learnable attention sinks (GPT-OSS's `s_aux`, FlashAttention-4's `learnable_sink`): one logit per
query head whose `exp` joins every row's softmax denominator, with no value behind it.

In lse terms a sink is one more state, output 0 and lse `sink[h]`, folded once into a call's finished
state: `lse' = logaddexp(lse, sink)`, `out' = out · exp(lse − lse')`. So sinks work on every backend and
across the ring (each rank folds them into its own rows, once), and the returned lse includes the sink
(FlashAttention-4's convention; CONVENTIONS.md §3). Rows that see no key give `out' = 0`, `lse' = sink`.

The fold runs inside the attention ops (`ringlse.ops`), so their backward starts from the folded `out'`
and `lse'`: the kernels' `P = exp(s − lse')` are then the probabilities with the sink, and the q/k/v
gradients need nothing more. The sink's own gradient is `d sink = −Σ_rows p_sink · delta'`, with
`p_sink = exp(sink − lse')` and `delta' = rowsum(dout · out') − dlse` (the kernels' delta).
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


def _sink_weight(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """`exp(sink − lse)` per row (`lse` `[b, h, s]`, with the sink folded in), 0 where lse is -inf."""
    s = sinks.to(lse.dtype)[None, :, None]
    return torch.where(torch.isfinite(lse), torch.exp(s - lse), torch.zeros_like(lse))


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out', lse')`: the finished state `out` `[b, s, h, d]`, `lse` `[b, h, s]` with the sinks `[h]`
    folded in; `out` is scaled in place (one read and one write; a fresh tensor of the op's)."""
    if sinks is None:
        return out, lse
    merged = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    # the attention state's weight exp(lse - lse') = 1 - p_sink; 0 on rows that saw no key
    weight = torch.where(torch.isfinite(lse), torch.exp(lse - merged), torch.zeros_like(lse))
    out.mul_(weight.transpose(1, 2)[..., None])
    return out, merged


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """`d sinks` `[h]` in the sinks' dtype: `−Σ_{b, rows} exp(sink − lse') · delta'`, where `lse'` is the
    folded lse and `delta'` `[b, h, s]` the backward's `rowsum(dout · out') − dlse`."""
    return -(_sink_weight(lse, sinks) * delta.to(lse.dtype)).sum((0, 2)).to(sinks.dtype)
