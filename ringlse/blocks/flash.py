"""The `fa2` block op: the flash-attn package's FlashAttention-2 kernels (`flash_attn`, CUDA sm80+ only).

The registry's `flash` is the best FlashAttention installed: `fa4` (`ringlse.blocks.fa4`) where
FlashAttention-4 imports and the GPU is sm90 or newer, else this one. `FLASH_BLOCK_OP` is this op
under the name it had before `fa4` existed (for callers that pass it as a `BlockOp`).

flash-attn is imported when this op first runs, so this module imports without it. We call its
internals `flash_attn.flash_attn_interface._flash_attn_forward` / `_flash_attn_backward`, which return
the lse natively and take the global `out`/`lse` in backward (as ring-flash-attn does). Their
signatures changed across 2.x releases (window_size in 2.3, alibi_slopes/deterministic in 2.4,
softcap in 2.6, window_size_left/right and a 4-tuple return in 2.6.3+/2.7), so arguments are passed by
parameter name and the lse is picked by the length of the returned tuple.

Everything else comes from the driver in `ringlse.blocks.fused`: causal blocks at global offsets are cut
into pieces and merged, except the bottom-right case `q_start - k_start == seqlen_k - seqlen_q`
(with `seqlen_q <= seqlen_k`), which flash-attn >= 2.1 runs in one call; the lse-gradient term for a
delta the kernels do not take. GQA is native (K/V are not repeated). Head dims that are not a multiple
of 8 are zero-padded (zeros add nothing to the scores) and sliced back. fp16/bf16 only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache

import torch

from ringlse.blocks.fused import KernelSet, fused_block_op, norm_lse
from ringlse.masks import Piece, split_causal_block


@cache
def _interface():
    """`flash_attn.flash_attn_interface` and its version as a tuple, imported on first use."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except ImportError as err:
        raise RuntimeError(f"the fa2 backend (FlashAttention-2) needs the flash-attn package: {err}") from err
    version = tuple(int(p) for p in flash_attn.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    return flash_attn_interface, version


@cache
def _signature(fn: Callable) -> inspect.Signature:
    """Signature of a flash-attn internal (a plain function or a `torch.library.custom_op`)."""
    for cand in (fn, getattr(fn, "_init_fn", None), getattr(fn, "__wrapped__", None)):
        if cand is None:
            continue
        try:
            return inspect.signature(cand)
        except (TypeError, ValueError):
            continue
    raise RuntimeError(f"cannot read the signature of {fn!r} (flash-attn version not supported)")


def _call_by_name(fn: Callable, **named):
    """Call `fn` with the arguments of `named` that its signature has; fail clearly on a missing one."""
    params = _signature(fn).parameters
    missing = [n for n, p in params.items() if n not in named and p.default is inspect.Parameter.empty]
    if missing:
        raise RuntimeError(f"flash-attn {fn.__name__} wants arguments we do not know: {missing}")
    return fn(**{n: named[n] for n in params if n in named})


def _pad8(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return x if d % 8 == 0 else torch.nn.functional.pad(x, (0, 8 - d % 8))


def _common(causal: bool, scale: float) -> dict:
    # every name some 2.x release uses; _call_by_name passes those the installed one has
    return dict(
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1), window_size_left=-1,
        window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False, return_softmax=False,
        rng_state=None,
    )


def _check_dtype(q: torch.Tensor) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the fa2 backend (flash-attn 2) supports fp16/bf16 only, got {q.dtype}")


def _flash_forward(q, k, v, causal, scale):
    _check_dtype(q)
    iface, _ = _interface()
    d = q.shape[-1]
    r = _call_by_name(iface._flash_attn_forward, q=_pad8(q), k=_pad8(k), v=_pad8(v), **_common(causal, scale))
    # 2.0-2.6: (out, q, k, v, out_padded, lse, S_dmask[, rng_state]); later: (out_padded, lse, S_dmask, rng_state)
    out, lse = r[0], (r[5] if len(r) >= 7 else r[1])
    return out[..., :d], norm_lse(lse, q.shape[1])  # +inf on empty rows -> -inf (CONVENTIONS.md §2)


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    _check_dtype(q)
    iface, _ = _interface()
    d = q.shape[-1]
    q8, k8, v8 = _pad8(q).contiguous(), _pad8(k).contiguous(), _pad8(v).contiguous()
    dq, dk, dv = torch.empty_like(q8), torch.empty_like(k8), torch.empty_like(v8)
    _call_by_name(
        iface._flash_attn_backward, dout=_pad8(dout).contiguous(), q=q8, k=k8, v=v8, out=_pad8(out).contiguous(),
        softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv, **_common(causal, scale),
    )
    return dq[..., :d], dk[..., :d], dv[..., :d]


def _flash_causal_pieces(sq: int, sk: int, q_start: int, k_start: int) -> list[Piece]:
    _, version = _interface()
    if version >= (2, 1) and sq <= sk and q_start - k_start == sk - sq:
        return [Piece(0, sq, 0, sk, True)]  # flash-attn >= 2.1 aligns causal masks bottom-right
    return split_causal_block(sq, sk, q_start, k_start)


FLASH_KERNELS = KernelSet(
    forward=_flash_forward, backward=_flash_backward, native_gqa=True, causal_pieces=_flash_causal_pieces
)


FA2_BLOCK_OP = fused_block_op("fa2", FLASH_KERNELS)
FLASH_BLOCK_OP = fused_block_op("flash", FLASH_KERNELS)  # the same op under its former registry name
