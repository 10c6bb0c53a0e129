"""THE merge formula (CONVENTIONS.md §3), the one copy on the PyTorch side: every merge of states
(`ringlse.merge`, `ringlse.merge_states`) and the `torch` block op's softmax use it; the kernels' copy
is `ringlse.kernels.merge_math`."""

from __future__ import annotations

import torch


def merge_weights(x: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """THE merge formula (CONVENTIONS.md §3): normalised weights and log-sum-exp of `x` along `dim`.

    `w_i = exp(x_i - lse)`, `lse = log sum_i exp(x_i)`, computed as `m + log sum exp(x_i - m)` with
    `m = max_i x_i` detached (a constant shift changes nothing) and replaced by 0 where every entry is
    `-inf`: such slices get weights 0 and lse `-inf`, and nothing differentiated ever sees
    `exp(-inf - -inf)` or `log(0)`. Merging states weighs their outs by `w` of their lses; softmax over
    scores is the same formula along the key dim.

    Args:
        x: any shape, float32 or float64; `-inf` entries allowed.
        dim: the dim reduced.

    Returns:
        `(w, lse)`: `w` like `x`, `lse` like `x` without `dim`.
    """
    if x.shape[dim] == 0:
        # nothing to merge (an empty key block): every slice is empty. Stay in the graph so that
        # autograd sees (zero) gradients.
        return x * 0.0, x.sum(dim=dim) + float("-inf")
    top = x.detach().amax(dim=dim, keepdim=True)
    empty = torch.isneginf(top)
    top = torch.where(empty, torch.zeros_like(top), top)
    e = torch.exp(x - top)
    total = e.sum(dim=dim, keepdim=True)
    total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), top + torch.log(total))
    return e / total, lse.squeeze(dim)
