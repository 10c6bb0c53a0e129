"""The `fa4` block op: FlashAttention-4 (`flash_attn.cute`, pip package flash-attn-4), CUDA sm90+ only.

FlashAttention-4 is written in the CuTe Python DSL and compiles each kernel configuration at its first
use. It is imported when this op first runs (or when the registry asks whether it can), so this
module imports without it. We call the internals of `flash_attn.cute.interface`, as found in
flash-attn-4 4.0.0b36, by keyword:

- `_flash_attn_fwd(q, k, v, ..., softmax_scale=None, causal=False, ..., window_size_left=None,
  window_size_right=None, ..., return_lse=False, ...)` -> `(out, lse, p, row_max, o_lo)`: `lse`
  `[b, h, sq]` float32, natural log, `-inf` on rows that see no key (`out` 0 there); None unless
  `return_lse=True` or an input requires grad.
- `_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
  window_size_left=None, window_size_right=None, ..., dlse=None, ...)` -> `(dq, dk, dv)` in the
  inputs' dtype: it takes the *global* `out`/`lse`, computes `rowsum(dout * out)` itself and
  subtracts `dlse` from it, so the lse gradient costs nothing extra (the driver's generic term costs
  a forward and a backward pass per piece); an lse of `+inf` gives `P = 0`.
- Causal masks and windows align bottom-right (key j visible to query i iff
  `j <= i + sk - sq [+ right]`), windows are `(left, right)` with None = unbounded (-1 is not
  "unbounded" there, except when both are negative); GQA is native (dk/dv come back with K/V's
  heads); fp16/bf16; head dims 8..256 in multiples of 8 on sm90 (8..128, (192, 128) or 256 on
  sm100); the backward asserts sm90 or newer. Both take `softcap` (forward None or > 0, backward 0 or
  > 0) and a V head dim of its own (out, dout, dv have V's); the sm90 backward takes GQA only with equal
  head dims (it asserts so), so K/V are repeated per query head for it there.

What this module adds, on the shared driver of `ringlse.blocks.fused`:
- causal blocks at any global offsets (CONVENTIONS.md §4): one call with FA4's right window bound where
  every row sees a key (`fa4_causal_pieces`: the ring's off-diagonal partial blocks), else at most two
  pieces of FA4's plain causal and non-causal kernels with disjoint query rows (no merge between them):
  `split_causal_block_bottom_right`;
- the lse in ringlse's convention (`norm_lse`: `[b, h, sq]` float32, `-inf` on empty rows);
- a backward that passes the lse gradient to FA4 as `dlse` (`bottom_right_block_op`);
- head dims refused unless checked: FA4's sm90 backward gives a wrong dq for head dims 8, 16, 40, 48,
  72, 80, 104 (mod 32 in {8, 16}; H200 and H100, 4.0.0b36; `VERIFIED_HEAD_DIMS`, and Q/K 192 with V 128
  in `VERIFIED_HEAD_DIM_PAIRS`);
- logit softcapping and a V head dim of its own passed to FA4 (`softcap=`).
- FA4's calls replayed past its Python wrapper once a call's signature repeats (`fa4_replay`).

Windows and documents: the op takes windows as a rule (`takes_window`: `window_size=` with causal and
the offsets, mapped to FA4's native bounds by `fa4_mask_args`), not per-row intervals (tensors: reading
a band back out of them would cost a device-to-host copy per block). Single-device callers cut a block
to the rows that see keys first and documents into one block each; the ring needs intervals, so a ring
with windows or documents raises a ValueError that names the backends taking them.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

import torch

from ringlse.blocks.contract import BlockGrads, BlockOp, Capabilities, Masks
from ringlse.blocks.fa4_replay import REPLAYED_RELEASES, Replayed
from ringlse.blocks.fused import (KernelSet, backward_operands, block_pieces, fused_block_forward,
                                  fused_block_states, norm_lse, parts_block_op)
from ringlse.masks import Piece, check_window
from ringlse.merge import GradPart

WRITTEN_FOR = "4.0.0b36"
# the keyword arguments we pass; a release without one of them is refused by name
_FWD_ARGS = ("q", "k", "v", "softmax_scale", "causal", "window_size_left", "window_size_right", "return_lse",
             "softcap")
_BWD_ARGS = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "window_size_left",
             "window_size_right", "dlse", "softcap")


def _params(fn: Callable) -> set[str] | None:
    for cand in (fn, getattr(fn, "__wrapped__", None)):
        if cand is None:
            continue
        try:
            return set(inspect.signature(cand).parameters)
        except (TypeError, ValueError):
            continue
    return None


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("flash-attn-4")
    except Exception:  # not installed as a distribution (a stand-in, a source tree)
        return None


@cache
def _load():
    """`(flash_attn.cute.interface, None)`, or `(None, why it cannot be used)`; tried once."""
    try:
        iface = importlib.import_module("flash_attn.cute.interface")
    except Exception as err:  # ImportError, or the CuTe DSL failing to load its libraries
        return None, (f"FlashAttention-4 (pip package flash-attn-4, module flash_attn.cute) does not import: "
                      f"{type(err).__name__}: {err}")
    for fn_name, needed in (("_flash_attn_fwd", _FWD_ARGS), ("_flash_attn_bwd", _BWD_ARGS)):
        fn = getattr(iface, fn_name, None)
        params = None if fn is None else _params(fn)
        lacking = sorted(set(needed) - params) if params is not None else None
        if fn is None or lacking:
            what = "is missing" if fn is None else ("has no readable signature" if lacking is None
                                                     else f"lacks the arguments {lacking}")
            return None, (f"FlashAttention-4 {_version() or '(version unknown)'}: flash_attn.cute.interface."
                          f"{fn_name} {what} (the fa4 backend is written against flash-attn-4 {WRITTEN_FOR})")
    return iface, None


def interface_missing() -> str | None:
    """Why FlashAttention-4's interface cannot be used, or None (the registry asks this)."""
    return _load()[1]


def _interface():
    iface, why = _load()
    if iface is None:
        raise RuntimeError(f"the fa4 backend needs FlashAttention-4: {why}")
    return iface


def _entry_points() -> tuple[Callable, Callable]:
    """FA4's `_flash_attn_fwd` and `_flash_attn_bwd`, replayed from recorded plans once a call's signature
    repeats (`fa4_replay`: most of their host time is their Python wrapper) where the release is one whose
    launches we read."""
    return _replayed(_interface())


@cache
def _replayed(iface) -> tuple[Callable, Callable]:
    if _version() not in REPLAYED_RELEASES:
        return iface._flash_attn_fwd, iface._flash_attn_bwd
    # every FA4 function with a compile cache (the interface's, and the kernels' modules': block sparsity's)
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("flash_attn.cute") and isinstance(m, types.ModuleType)]
    caches = list({id(f): f for m in [iface, *modules] for f in vars(m).values()
                   if isinstance(f, types.FunctionType) and "compile_cache" in vars(f)}.values())
    return Replayed(iface._flash_attn_fwd, caches), Replayed(iface._flash_attn_bwd, caches)


# Head dims whose FA4 backward we checked against a float64 reference on sm90 (H200, 4.0.0b36, bf16, causal
# and not, bare FA4 without ringlse): dq is right for these and wrong (relative error 0.3-1.3) for
# 8, 16, 40, 48, 72, 80, 104 (head dim mod 32 in {8, 16}); the forward, dk and dv were right for all.
# Head dims not checked (112, 120, 136 and up) are refused too: a wrong gradient is a silent wrong answer.
VERIFIED_HEAD_DIMS = (24, 32, 56, 64, 88, 96, 128)
# (Q/K, V) head dims that differ, checked the same way through ringlse (DeepSeek-V3's MLA, tests/test_fa4_gpu.py)
VERIFIED_HEAD_DIM_PAIRS = ((192, 128),)


def head_dim_refused(head_dim: int, v_head_dim: int | None = None) -> str | None:
    """Why the fa4 backend refuses Q/K head dim `head_dim` with V head dim `v_head_dim` (None: the same),
    or None."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if (head_dim == v_head_dim and head_dim in VERIFIED_HEAD_DIMS) or (head_dim, v_head_dim) in VERIFIED_HEAD_DIM_PAIRS:
        return None
    dims = f"{head_dim}" if head_dim == v_head_dim else f"(Q/K {head_dim}, V {v_head_dim})"
    return (f"the fa4 backend (FlashAttention-4 {WRITTEN_FOR}) takes head dims {list(VERIFIED_HEAD_DIMS)} and "
            f"(Q/K, V) {list(VERIFIED_HEAD_DIM_PAIRS)}, got {dims}: FA4's backward gave a wrong dq for head dims "
            f"8, 16, 40, 48, 72, 80, 104 on H200, and other dims are unchecked (the triton and torch backends take "
            f"it{'' if head_dim != v_head_dim else ', and sdpa'})")


def _check_inputs(q: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the fa4 backend (FlashAttention-4) supports fp16/bf16 only, got {q.dtype}")
    why = head_dim_refused(q.shape[-1], v.shape[-1])
    if why is not None:
        raise ValueError(why)


@dataclass(frozen=True)
class Band:
    """A piece's mask for FA4 beyond plain causal: key j visible to query i iff
    `i + (sk - sq) - left <= j <= i + (sk - sq) + right` (FA4's `window_size_left`/`_right`, bottom-right
    aligned; None = unbounded)."""

    right: int | None
    left: int | None = None


def _mask_kwargs(causal: bool | Band) -> dict:
    if isinstance(causal, Band):
        return dict(causal=False, window_size_left=causal.left, window_size_right=causal.right)
    return dict(causal=causal, window_size_left=None, window_size_right=None)


def _fa4_forward(q, k, v, causal, scale, softcap=0.0):
    """One FA4 forward call (causal: bottom-right, or a `Band`; scores capped at `softcap` > 0) ->
    `(out, lse)` in ringlse's lse convention."""
    _check_inputs(q, v)
    res = _entry_points()[0](q, k, v, softmax_scale=scale, **_mask_kwargs(causal), return_lse=True,
                                       softcap=softcap or None)
    out, lse = res[0], res[1]
    return out, norm_lse(lse, q.shape[1])


def _fa4_backward(dout, q, k, v, out, lse, causal, scale, dlse=None, softcap=0.0):
    """One FA4 backward call with the global `out`/`lse` rows (and lse gradient `dlse`) -> `(dq, dk, dv)`."""
    _check_inputs(q, v)
    h, hkv = q.shape[2], k.shape[2]
    group = h // hkv if q.shape[-1] != v.shape[-1] else 1
    if group > 1:  # FA4's sm90 backward takes GQA only with equal head dims: K/V repeated per query head
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    dq, dk, dv = _entry_points()[1](
        q, k, v, out, dout, lse.float().contiguous(), softmax_scale=scale, **_mask_kwargs(causal),
        dlse=None if dlse is None else dlse.float().contiguous(), softcap=softcap,
    )[:3]
    if group > 1:  # the repeated heads' gradients summed back per K/V head, in float32
        dk, dv = (g.unflatten(2, (hkv, group)).sum(3, dtype=torch.float32) for g in (dk, dv))
    return dq, dk, dv


def fa4_causal_pieces(seqlen_q: int, seqlen_k: int, q_start: int, k_start: int) -> list[Piece]:
    """A causal block at global offsets for FA4: one call with a `Band` where every query row sees its
    first key (`q_start >= k_start`) and the diagonal sits right of FA4's causal one, as bare FA4 takes
    it (two calls cost up to 1.10x bare FA4's time on H200 at S 8K, d 64); otherwise the
    pieces of `split_causal_block_bottom_right`."""
    shift = (q_start - k_start) - (seqlen_k - seqlen_q)
    if q_start >= k_start and shift > 0 and seqlen_q and seqlen_k:
        if q_start - k_start >= seqlen_k - 1:  # every row sees every key
            return [Piece(0, seqlen_q, 0, seqlen_k, False)]
        return [Piece(0, seqlen_q, 0, seqlen_k, Band(shift))]
    return split_causal_block_bottom_right(seqlen_q, seqlen_k, q_start, k_start)


def split_causal_block_bottom_right(seqlen_q: int, seqlen_k: int, q_start: int, k_start: int) -> list[Piece]:
    """Cover a causal block at global offsets (key j visible to query i iff `k_start + j <= q_start + i`)
    with at most two pieces for kernels whose causal mask is bottom-right aligned on any shape
    (FlashAttention-4, flash-attn >= 2.1): a causal piece `q[i0:r1] x k[0:r1 + offset]`, whose
    bottom-right diagonal is exactly the block's, then the rows that see every key as one plain
    piece. Rows before `i0` see nothing and are left out; the causal piece never has more rows than
    keys, so it has no empty row either, and the two pieces share no query row."""
    offset = q_start - k_start  # row i sees keys j <= i + offset
    i0 = max(0, -offset)
    if i0 >= seqlen_q or seqlen_k <= 0:
        return []
    r1 = max(i0, min(seqlen_q, seqlen_k - offset))  # rows from r1 on see all seqlen_k keys
    pieces: list[Piece] = []
    if r1 > i0:
        pieces.append(Piece(i0, r1, 0, r1 + offset, True))
    if r1 < seqlen_q:
        pieces.append(Piece(r1, seqlen_q, 0, seqlen_k, False))
    return pieces


def _native_lse_grad_parts(ks: KernelSet, dout, q, k, v, out, lse, delta, *, softmax_scale: float, causal: bool,
                           q_start: int, k_start: int, lse_grad: torch.Tensor | None = None,
                           window_size: tuple[int, int] | None = None, softcap: float = 0.0) -> BlockGrads:
    """The block-op `backward_parts` for kernels whose backward takes the lse gradient (`dlse=`):
    one backward call per piece, gradients as the kernels return them. `delta` is not read.
    Its parameters are the block-op contract's (`ringlse.blocks.contract`), one per operand and mask argument."""
    sq, sk = q.shape[1], k.shape[1]
    grads = BlockGrads([], [], [])
    with torch.no_grad():
        pieces = block_pieces(ks, sq, sk, q_start, k_start, causal, window_size)
        if not pieces:
            return grads
        # rows that saw nothing anywhere get lse +inf, so P = 0 (FA4 reads -inf as 0, which would not)
        dout, out, _, lse, e = backward_operands(q, dout, out, lse, lse_grad)
        for p in pieces:
            rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
            dq, dk, dv = ks.backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows],
                                     p.causal, softmax_scale, dlse=None if e is None else e[:, :, rows],
                                     **({"softcap": softcap} if softcap else {}))
            grads.dq.append(GradPart(p.q0, dq))
            grads.dk.append(GradPart(p.k0, dk))
            grads.dv.append(GradPart(p.k0, dv))
    return grads


def fa4_window_pieces(seqlen_q: int, seqlen_k: int, q_start: int, k_start: int, causal: bool,
                      window_size: tuple[int, int]) -> list[Piece]:
    """A block under a window (and causal) rule as one FA4 call: plain causal or non-causal where the
    rule is that, else a `Band` (`fa4_mask_args`). Callers cut the block to the rows that see keys and
    the keys they see first (`ringlse.masks.Intervals.box`): then the last row's left bound and the last
    key seen keep both of FA4's bounds >= 0, which `fa4_mask_args` checks (ValueError otherwise)."""
    if not (seqlen_q and seqlen_k):
        return []
    plain_causal, (left, right) = fa4_mask_args(seqlen_q, seqlen_k, q_start, k_start, causal, window_size)
    if left is None and right is None:
        return [Piece(0, seqlen_q, 0, seqlen_k, plain_causal)]
    return [Piece(0, seqlen_q, 0, seqlen_k, Band(right=right, left=left))]


def bottom_right_block_op(name: str, forward: Callable, backward: Callable,
                          causal_pieces: Callable = split_causal_block_bottom_right,
                          window_pieces: Callable | None = None, features: bool = False) -> BlockOp:
    """A block op over kernels with FlashAttention-4's conventions: `forward(q, k, v, causal, scale)
    -> (out, lse)`, `backward(dout, q, k, v, out, lse, causal, scale, dlse=None) -> (dq, dk, dv)`,
    causal bottom-right on any shape, native GQA; `causal_pieces` cuts causal blocks for them. Forward
    (and `forward_parts`) run on the shared driver; backward passes the lse gradient to the kernels. With
    `features`, both also take `softcap=` and a V head dim of its own (FlashAttention-4's do)."""
    ks = KernelSet(forward=forward, backward=backward, native_gqa=True, causal_pieces=causal_pieces,
                   window_pieces=window_pieces)
    caps = Capabilities(Masks.WINDOW if window_pieces is not None else Masks.PLAIN, softcap=features,
                        v_head_dim=features)
    return parts_block_op(name, partial(fused_block_forward, ks), partial(fused_block_states, ks),
                          partial(_native_lse_grad_parts, ks), caps)


def fa4_mask_args(seqlen_q: int, seqlen_k: int, q_start: int, k_start: int, causal: bool,
                  window_size: tuple[int, int] = (-1, -1)) -> tuple[bool, tuple[int | None, int | None]]:
    """FA4's native `(causal, window_size)` for a block of `seqlen_q` queries at `q_start` and
    `seqlen_k` keys at `k_start` under ringlse's rule (CONVENTIONS.md §4, §10: `window_size`
    `(left, right)`, -1 unbounded), for FA4's bottom-right alignment and None = unbounded.

    Raises:
        ValueError: a window bound FA4 would need below zero (it is not known to take those, and it
            reads two negative bounds as "unbounded").
    """
    left, right = check_window(window_size, "fa4_mask_args")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    shift = (q_start - k_start) - (seqlen_k - seqlen_q)  # ringlse's diagonal relative to FA4's
    wl = None if left < 0 else left - shift
    wr = None if right < 0 else right + shift
    if wl is None and wr is None:
        return False, (None, None)
    if wl is None and wr == 0:
        return True, (None, None)
    bad = [f"{n} {w}" for n, w in (("left", wl), ("right", wr)) if w is not None and w < 0]
    if bad:
        raise ValueError(f"fa4_mask_args: FlashAttention-4 would need a negative window bound ({', '.join(bad)}) "
                         f"for causal={causal}, window_size={window_size} at q_start={q_start}, k_start={k_start} "
                         f"with {seqlen_q} queries and {seqlen_k} keys")
    return False, (wl, wr)


FA4_KERNELS = KernelSet(forward=_fa4_forward, backward=_fa4_backward, native_gqa=True,
                        causal_pieces=fa4_causal_pieces, window_pieces=fa4_window_pieces)

FA4_BLOCK_OP = bottom_right_block_op("fa4", _fa4_forward, _fa4_backward, fa4_causal_pieces, fa4_window_pieces,
                                     features=True)

__all__ = ["FA4_BLOCK_OP", "FA4_KERNELS", "VERIFIED_HEAD_DIMS", "VERIFIED_HEAD_DIM_PAIRS", "Band", "fa4_causal_pieces", "fa4_window_pieces",
           "bottom_right_block_op", "fa4_mask_args",
           "head_dim_refused", "interface_missing", "split_causal_block_bottom_right"]
