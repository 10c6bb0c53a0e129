"""The `triton` block op: ringlse's Triton kernels (`ringlse.kernels.attention_fwd` / `_bwd`) behind
the block-op contract. The kernels take plain tensors and integers; the contract's callers already
skip blocks with nothing visible and pass `causal=True` only where a causal boundary crosses the
block (`ringlse.masks.block_kind`), which is what the kernels ask of their callers. Windows and
documents arrive as `intervals` (`ringlse.masks.Intervals`) and go to the kernels as per-row int32
bounds on the inputs' device."""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ringlse.blocks.contract import BlockOp, Capabilities, Masks
from ringlse.kernel_import import kernel_module
from ringlse.masks import Intervals

_fwd = kernel_module("attention_fwd")
_bwd = kernel_module("attention_bwd")
_launch = kernel_module("launch")
if _fwd is None or _bwd is None or _launch is None:
    raise ImportError("the triton backend needs Triton and the installed ringlse.kernels")


# device copies of interval bounds, by the CPU tensor (the plans cache theirs: every layer and call of a
# ring reads the same ones) and by (device, stream): a copy is read on the stream that made it
_ON_DEVICE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _on(device: torch.device, x: torch.Tensor) -> torch.Tensor:
    if device.type != "cuda" or x.device == device or torch.cuda.is_current_stream_capturing():
        return x.to(device, non_blocking=True)
    copies = _ON_DEVICE.setdefault(x, {})
    where = (device.index, _launch.current_raw_stream(device.index))
    got = copies.get(where)
    if got is None:
        got = copies[where] = x.to(device, non_blocking=True)
    return got


def triton_block_forward(q, k, v, *, intervals: Intervals | None = None, **block):
    if intervals is not None:
        block.update(key_lo=_on(q.device, intervals.key_lo), key_hi=_on(q.device, intervals.key_hi))
    return _fwd.attention_forward(q, k, v, **block)


def triton_block_backward(dout, q, k, v, out, lse, delta, *, intervals: Intervals | None = None, **block) -> None:
    if intervals is not None:
        block.update({name: _on(q.device, getattr(intervals, name)) for name in Intervals._fields})
    _bwd.attention_backward(dout, q, k, v, out, lse, delta, **block)


TRITON_BLOCK_OP = BlockOp("triton", triton_block_forward, triton_block_backward,
                          Capabilities(Masks.INTERVALS, split_backward=True, writes_fresh=True,
                                       dq_with_dkdv=_bwd.dq_with_dkdv, softcap=True, v_head_dim=True,
                                       sinks=True),
                          delta=_bwd.attention_delta)
