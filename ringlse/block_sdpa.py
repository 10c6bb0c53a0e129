"""The `sdpa` block op: PyTorch's fused attention kernels, which return the lse a ring needs.

Kernels, tried in this order; the first that accepts the inputs runs, and a kernel that raised for a
(device, dtype, head dim) is not asked again for it (a warning names the error once):

| name        | op (`torch.ops.aten.*`)                                   | dtypes          |
| ----------- | --------------------------------------------------------- | --------------- |
| `cudnn`     | `_scaled_dot_product_cudnn_attention` (+`_backward`)       | fp16, bf16      |
| `flash`     | `_scaled_dot_product_flash_attention` (+`_backward`)       | fp16, bf16      |
| `efficient` | `_scaled_dot_product_efficient_attention` (+`_backward`)   | fp16, bf16, fp32|
| `math`      | `ringlse.block_torch` (PyTorch math, `O(sq * sk)` memory)   | any             |

cuDNN is the fastest on H100/H200 (DESIGN §9). On CPU the op runs `flash_cpu`
(`_scaled_dot_product_flash_attention_for_cpu`) then `math`: the registry offers `sdpa` on CUDA only,
but the CPU kernels let every line of this module be tested without a GPU.

What the ops cannot do, this module does around them:
- Masks: the ops know "no mask" and "top-left causal" only. A causal block at global offsets is cut by
  `positions.split_causal_block_top_left` into at most two pieces (the keys every row sees, and one
  top-left causal piece of any shape) whose states are merged (DESIGN §3) in one pass by
  `state_parts.merge_parts` (a fused kernel on CUDA), or into a caller's accumulators;
  `forward_parts` returns them unmerged, for a caller that merges many blocks at once. Rows that see
  no key stay `(0, -inf)`. PyTorch's CUDA flash kernel aligns a non-square causal mask bottom-right
  (measured, torch 2.11), so it gets top-left pieces of other shapes as squares plus full rectangles.
- GQA: K/V are repeated to `nheads` (a copy of K/V per call; the ops' GQA support varies between
  kernels and torch versions) and dk/dv are summed back over each group.
- Backward with the global `out`/`lse` (DESIGN §6): the backward ops take them as they are, but they
  compute `delta = rowsum(dout * out)` themselves instead of taking ours. Without an lse gradient
  (the block-op contract passes `lse_grad=None`) that is the same delta and costs nothing more. An
  lse gradient `e` (delta shifted by it) adds `dS_ij = P_ij * e_i`, which we get from the same
  kernels: `dq_i += scale * e_i * sum_j P_ij k_j` (attention with V = K) and
  `dk_j += scale * sum_i P_ij e_i q_i` (the dv of a backward pass whose dout is `e * q`).
- lse: normalised to `[b, h, sq]` float32 (cuDNN returns `[b, h, sq, 1]` in some torch versions,
  efficient attention pads `sq` to a multiple of 32); an empty row is `-inf`, never `+inf`.
"""

from __future__ import annotations

import contextlib
import warnings
from functools import cache, partial
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ringlse.block_torch import torch_block_backward, torch_block_forward
from ringlse.blockop import BlockGrads, BlockOp, GradPart, StatePart
from ringlse.merge import update_out_and_lse
from ringlse.part_sum import add_parts
from ringlse.positions import Piece, split_causal_block, split_causal_block_top_left
from ringlse.reference import lse_dtype
from ringlse.state_parts import merge_parts

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------------
# calling the aten ops by argument name (their positional order changed between torch versions)


@cache
def _schema(op_name: str) -> tuple[object, tuple[tuple[str, bool], ...]]:
    """`torch.ops.aten.<op_name>.default` and its arguments as `(name, required)` (read once: walking
    the schema costs host time on every block call otherwise)."""
    op = getattr(aten, op_name).default
    return op, tuple((arg.name, not arg.has_default_value()) for arg in op._schema.arguments)


def _call(op_name: str, **named):
    """Call `torch.ops.aten.<op_name>.default` with its arguments passed by schema name.

    Names the schema lacks are dropped (older torch); a required argument we have no value for
    raises TypeError, which makes the caller fall back to the next kernel.
    """
    op, args = _schema(op_name)
    kwargs = {}
    for name, required in args:
        if name in named:
            kwargs[name] = named[name]
        elif required:
            raise TypeError(f"{op_name}: no value for its argument {name!r} (torch {torch.__version__})")
    return op(**kwargs)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """`[b, s, h, d]` -> the `[b, h, s, d]` view the SDPA ops take (no copy)."""
    return x.transpose(1, 2)


def _norm_lse(lse: torch.Tensor, sq: int) -> torch.Tensor:
    """Any lse an op returns -> `[b, h, sq]`, `-inf` (not `+inf`) on empty rows."""
    if lse.dim() == 4:  # cuDNN in some torch versions: [b, h, sq, 1]
        lse = lse[..., 0]
    lse = lse[..., :sq]  # efficient attention pads sq to a multiple of 32
    if lse.dtype not in (torch.float32, torch.float64):
        lse = lse.float()
    return lse.masked_fill(lse == float("inf"), float("-inf"))


@cache
def _zero_rng(device: torch.device) -> torch.Tensor:
    # dropout is 0, so the kernels never read the philox seed/offset; they still need tensors (one
    # per device, never written: a fill kernel per block call otherwise)
    return torch.zeros((), dtype=torch.int64, device=device)


# ------------------------------------------------------------------------------------------------
# the kernels: forward(q, k, v, causal, scale) -> (out, lse); backward(dout, q, k, v, out, lse,
# causal, scale) -> (dq, dk, dv). All tensors [b, s, h, d] with as many K/V heads as Q heads;
# `causal` is top-left; `lse` in backward is the global lse with +inf on empty rows.


_CUDNN_LSE_DIM: int | None = None  # how the installed torch shapes cuDNN's lse ([b,h,s] or [b,h,s,1])


def _packed(*xs: torch.Tensor) -> list[torch.Tensor]:
    # cuDNN returned a wrong dk (dq, dv right) on H200/torch 2.11 for batch > 1 when K was a slice
    # with a batch stride larger than its size (a causal piece of a longer K); packed copies fix
    # that. Whole blocks, the ring's usual case, are contiguous already and are not copied.
    return [x if x.is_contiguous() else x.contiguous() for x in xs]


def _cudnn_forward(q, k, v, causal, scale):
    global _CUDNN_LSE_DIM
    q, k, v = _packed(q, k, v)
    r = _call(
        "_scaled_dot_product_cudnn_attention",
        query=_bhsd(q), key=_bhsd(k), value=_bhsd(v), attn_bias=None, compute_log_sumexp=True,
        dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale,
    )
    _CUDNN_LSE_DIM = r[1].dim()
    return _bhsd(r[0]), _norm_lse(r[1], q.shape[1])


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    if _CUDNN_LSE_DIM is None:  # a backward before any forward in this process: ask the op once
        probe = torch.randn(1, 64, 1, q.shape[-1], dtype=q.dtype, device=q.device)
        _cudnn_forward(probe, probe, probe, False, 1.0)
    lse = lse.contiguous() if _CUDNN_LSE_DIM == 3 else lse.unsqueeze(-1).contiguous()
    dout, q, k, v, out = _packed(dout, q, k, v, out)
    rng = _zero_rng(q.device)
    dq, dk, dv = _call(
        "_scaled_dot_product_cudnn_attention_backward",
        grad_out=_bhsd(dout), query=_bhsd(q), key=_bhsd(k), value=_bhsd(v), out=_bhsd(out), logsumexp=lse,
        philox_seed=rng, philox_offset=rng, attn_bias=None, cum_seq_q=None, cum_seq_k=None,
        max_q=q.shape[1], max_k=k.shape[1], dropout_p=0.0, is_causal=causal, scale=scale,
    )[:3]
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _flash_forward(q, k, v, causal, scale):
    sq, sk = q.shape[1], k.shape[1]
    if causal and sq < sk:  # top-left: keys past the last query are never seen
        return _flash_forward(q, k[:, :sq], v[:, :sq], True, scale)
    if causal and sq > sk:  # top-left: the square, then rows that see every key
        (o1, l1), (o2, l2) = _flash_forward(q[:, :sk], k, v, True, scale), _flash_forward(q[:, sk:], k, v, False, scale)
        return torch.cat([o1, o2], 1), torch.cat([l1, l2], 2)
    r = _call(
        "_scaled_dot_product_flash_attention",
        query=_bhsd(q), key=_bhsd(k), value=_bhsd(v), dropout_p=0.0, is_causal=causal,
        return_debug_mask=False, scale=scale,
    )
    return _bhsd(r[0]), _norm_lse(r[1], q.shape[1])


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    sq, sk = q.shape[1], k.shape[1]
    if causal and sq != sk:  # top-left, as `_flash_forward` cuts it
        m = min(sq, sk)
        dq, dk, dv = _flash_backward(dout[:, :m], q[:, :m], k[:, :m], v[:, :m], out[:, :m], lse[:, :, :m], True, scale)
        if sq < sk:
            pad = lambda x: torch.cat([x, x.new_zeros((x.shape[0], sk - sq, *x.shape[2:]))], 1)
            return dq, pad(dk), pad(dv)
        dq2, dk2, dv2 = _flash_backward(dout[:, sk:], q[:, sk:], k, v, out[:, sk:], lse[:, :, sk:], False, scale)
        return torch.cat([dq, dq2], 1), dk + dk2, dv + dv2
    rng = _zero_rng(q.device)
    dq, dk, dv = _call(
        "_scaled_dot_product_flash_attention_backward",
        grad_out=_bhsd(dout), query=_bhsd(q), key=_bhsd(k), value=_bhsd(v), out=_bhsd(out),
        logsumexp=lse.contiguous(), cum_seq_q=None, cum_seq_k=None, max_q=q.shape[1], max_k=k.shape[1],
        dropout_p=0.0, is_causal=causal, philox_seed=rng, philox_offset=rng, scale=scale,
    )[:3]
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _efficient_forward(q, k, v, causal, scale):
    r = _call(
        "_scaled_dot_product_efficient_attention",
        query=_bhsd(q), key=_bhsd(k), value=_bhsd(v), attn_bias=None, compute_log_sumexp=True,
        dropout_p=0.0, is_causal=causal, scale=scale,
    )
    return _bhsd(r[0]), _norm_lse(r[1], q.shape[1])


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    # the kernel was written for the lse its forward returns, padded to a multiple of 32 queries
    b, h, sq = lse.shape
    padded = torch.zeros(b, h, -(-sq // 32) * 32, dtype=torch.float32, device=lse.device)
    padded[..., :sq] = lse
    rng = _zero_rng(q.device)
    dq, dk, dv = _call(
        "_scaled_dot_product_efficient_attention_backward",
        grad_out_=_bhsd(dout), query=_bhsd(q), key=_bhsd(k), value=_bhsd(v), attn_bias=None, out=_bhsd(out),
        logsumexp=padded, philox_seed=rng, philox_offset=rng, dropout_p=0.0,
        grad_input_mask=[True, True, True, False], is_causal=causal, scale=scale,
    )[:3]
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _flash_cpu_forward(q, k, v, causal, scale):
    out, lse = _call(
        "_scaled_dot_product_flash_attention_for_cpu",
        query=_bhsd(q), key=_bhsd(k), value=_bhsd(v), dropout_p=0.0, is_causal=causal, attn_mask=None, scale=scale,
    )[:2]
    return _bhsd(out), _norm_lse(lse, q.shape[1])


def _flash_cpu_backward(dout, q, k, v, out, lse, causal, scale):
    dq, dk, dv = _call(
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        grad_out=_bhsd(dout), query=_bhsd(q), key=_bhsd(k), value=_bhsd(v), out=_bhsd(out),
        logsumexp=lse.contiguous(), dropout_p=0.0, is_causal=causal, attn_mask=None, scale=scale,
    )[:3]
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _math_forward(q, k, v, causal, scale):
    return torch_block_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=0, k_start=0)


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    acc = lse_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # what the fused kernels compute
    torch_block_backward(
        dout, q, k, v, out, lse, delta, softmax_scale=scale, causal=causal, q_start=0, k_start=0,
        dq_acc=dq, dk_acc=dk, dv_acc=dv,
    )
    return dq, dk, dv


@dataclass(frozen=True)
class Kernel:
    """One fused kernel pair; `dtypes` filters what it is offered (it may still raise)."""

    name: str
    forward: Callable
    backward: Callable
    dtypes: tuple[torch.dtype, ...]


_HALF = (torch.float16, torch.bfloat16)
_ANY = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("cudnn", _cudnn_forward, _cudnn_backward, _HALF),
        Kernel("flash", _flash_forward, _flash_backward, _HALF),
        Kernel("efficient", _efficient_forward, _efficient_backward, (*_HALF, torch.float32)),
        Kernel("flash_cpu", _flash_cpu_forward, _flash_cpu_backward, _ANY),
        Kernel("math", _math_forward, _math_backward, _ANY),
    )
}
_DEFAULT_ORDER = {"cuda": ("cudnn", "flash", "efficient", "math"), "cpu": ("flash_cpu", "math")}


@dataclass
class _State:
    order: tuple[str, ...] | None = None  # set by use_kernels()
    rejected: dict[tuple, set[str]] = field(default_factory=dict)
    last_used: dict[str, str] = field(default_factory=dict)


_STATE = _State()


@contextlib.contextmanager
def use_kernels(*names: str) -> Iterator[None]:
    """Within the block, try only these kernels, in this order (for tests and benchmarks).

    Example: `with use_kernels("flash"): ...` runs the flash kernels or raises.
    """
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"unknown sdpa kernels {unknown}; known: {list(KERNELS)}")
    before = _STATE.order
    _STATE.order = tuple(names)
    try:
        yield
    finally:
        _STATE.order = before


def last_kernels() -> dict[str, str]:
    """Which kernel served the latest `forward` and `backward` call (e.g. `{"forward": "cudnn"}`)."""
    return dict(_STATE.last_used)


def _run(phase: str, q: torch.Tensor, *args):
    """Run `phase` ("forward"/"backward") on the first kernel that accepts the inputs."""
    order = _STATE.order or _DEFAULT_ORDER.get(q.device.type, ("math",))
    key = (q.device, q.dtype, q.shape[-1], phase)
    rejected = _STATE.rejected.setdefault(key, set())
    errors = []
    for name in order:
        kernel = KERNELS[name]
        if name in rejected or q.dtype not in kernel.dtypes:
            continue
        try:
            result = getattr(kernel, phase)(*args)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, AttributeError, NotImplementedError) as err:
            rejected.add(name)
            errors.append(f"{name}: {err}")
            warnings.warn(
                f"ringlse sdpa: the {name} kernel rejected {phase} for {q.dtype}, head dim {q.shape[-1]} on "
                f"{q.device} ({str(err).splitlines()[0][:200]}); trying the next one",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        _STATE.last_used[phase] = name
        return result
    raise RuntimeError(f"ringlse sdpa: no kernel among {order} accepts {phase} here: {errors or 'dtype not supported'}")


@dataclass(frozen=True)
class _KernelSet:
    """What the piece-and-merge driver below needs from a family of fused kernels."""

    forward: Callable  # (q, k, v, causal, scale) -> (out, lse)
    backward: Callable  # (dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)
    native_gqa: bool  # kernels take fewer K/V heads than Q heads
    # (sq, sk, q_start, k_start) -> pieces of a causal block, each causal piece aligned as the kernels
    # align it: top-left for the SDPA kernels; flash-attn's are bottom-right (top-left on a square)
    causal_pieces: Callable[[int, int, int, int], list[Piece]] = split_causal_block


SDPA_KERNELS = _KernelSet(
    forward=lambda q, k, v, causal, scale: _run("forward", q, q, k, v, causal, scale),
    backward=lambda dout, q, k, v, out, lse, causal, scale: _run("backward", q, dout, q, k, v, out, lse, causal, scale),
    native_gqa=False,
    causal_pieces=split_causal_block_top_left,
)


# ------------------------------------------------------------------------------------------------
# the driver shared with the flash-attn backend: pieces, GQA, merge, lse-gradient term


def _pieces(ks: _KernelSet, sq: int, sk: int, q_start: int, k_start: int, causal: bool) -> list[Piece]:
    if not causal:
        return [Piece(0, sq, 0, sk, False)] if sq and sk else []
    return ks.causal_pieces(sq, sk, q_start, k_start)


def _expand_kv(ks: _KernelSet, x: torch.Tensor, nheads: int) -> torch.Tensor:
    b, s, hkv, d = x.shape
    if ks.native_gqa or hkv == nheads:
        return x
    return x[:, :, :, None, :].expand(b, s, hkv, nheads // hkv, d).reshape(b, s, nheads, d)


def _sum_groups(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """`[b, s, h, d]` gradient of repeated K/V -> `[b, s, hkv, d]` (sum over each group in float32/float64;
    without groups `x` itself: the in-place add into the accumulator converts as it reads)."""
    b, s, h, d = x.shape
    if h == hkv:
        return x
    return x.reshape(b, s, hkv, h // hkv, d).sum(3, dtype=lse_dtype(x.dtype))


def fused_block_states(
    ks: _KernelSet,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
) -> list[StatePart]:
    """The block-op `forward_parts` (see `ringlse.blockop`) over a family of fused kernels: one state
    per piece of the block, as the kernels return it (`out` in q's dtype), never merged."""
    h = q.shape[2]
    acc = lse_dtype(q.dtype)
    states = []
    with torch.no_grad():
        k, v = _expand_kv(ks, k, h), _expand_kv(ks, v, h)
        for p in _pieces(ks, q.shape[1], k.shape[1], q_start, k_start, causal):
            out, lse = ks.forward(q[:, p.q0 : p.q1], k[:, p.k0 : p.k1], v[:, p.k0 : p.k1], p.causal, softmax_scale)
            states.append(StatePart(p.q0, out, lse.to(acc)))
    return states


def fused_block_forward(
    ks: _KernelSet,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    out_acc: torch.Tensor | None = None,
    lse_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-op forward (see `ringlse.blockop`) over a family of fused kernels: the pieces' states
    merged in one pass (a lone whole piece, the common case, as it is) or into the accumulators."""
    states = fused_block_states(ks, q, k, v, softmax_scale=softmax_scale, causal=causal, q_start=q_start,
                                k_start=k_start)
    if out_acc is None:
        return merge_parts(q.shape, states, q.dtype, q.device, lse_dtype(q.dtype))
    with torch.no_grad():
        for p in states:
            rows = slice(p.start, p.start + p.out.shape[1])
            update_out_and_lse(out_acc[:, rows], lse_acc[:, :, rows], p.out, p.lse, inplace=True)
    return out_acc, lse_acc


def fused_block_parts(
    ks: _KernelSet,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor | None,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    lse_grad: torch.Tensor | None = None,
) -> BlockGrads:
    """The block-op `backward_parts` (see `ringlse.blockop`) over a family of fused kernels: the
    kernels' own output tensors (q's dtype; float32 where GQA groups are summed or for the lse-gradient
    term), never added into anything. `delta` is not read: the kernels compute `rowsum(dout * out)`
    themselves and `lse_grad` adds the rest."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    acc = lse_dtype(q.dtype)
    grads = BlockGrads([], [], [])
    with torch.no_grad():
        pieces = _pieces(ks, sq, sk, q_start, k_start, causal)
        if not pieces:
            return grads
        # same dtype and (contiguous) strides for out and dout: cuDNN < 9.5.1 requires equal strides
        dout = dout.to(q.dtype).contiguous()
        out = out.to(q.dtype).contiguous()
        e = None if lse_grad is None else lse_grad.to(acc)
        lse = lse.to(acc)
        # kernels compute P = exp(s - lse): +inf turns rows that saw nothing anywhere into P = 0
        lse_k = lse.masked_fill(lse == float("-inf"), float("inf"))
        k, v = _expand_kv(ks, k, h), _expand_kv(ks, v, h)
        for p in pieces:
            rows, keys = slice(p.q0, p.q1), slice(p.k0, p.k1)
            qp, kp, vp, op, dop = q[:, rows], k[:, keys], v[:, keys], out[:, rows], dout[:, rows]
            dq, dk, dv = ks.backward(dop, qp, kp, vp, op, lse_k[:, :, rows], p.causal, softmax_scale)
            grads.dq.append(GradPart(p.q0, dq))
            grads.dk.append(GradPart(p.k0, _sum_groups(dk, hkv)))
            grads.dv.append(GradPart(p.k0, _sum_groups(dv, hkv)))
            if e is None:
                continue
            # delta = rowsum(dout * out) - e adds dS_ij = P_ij e_i (module docstring)
            ep = e[:, :, rows]
            o_kk, lse_blk = ks.forward(qp, kp, kp, p.causal, softmax_scale)  # sum_j exp(s_ij - lse_blk_i) k_j
            glob = lse[:, :, rows]
            w = torch.where(torch.isfinite(glob), torch.exp(lse_blk.to(acc) - glob), torch.zeros_like(glob))
            grads.dq.append(GradPart(p.q0, (softmax_scale * ep * w).transpose(1, 2).unsqueeze(-1) * o_kk.to(acc)))
            eq = (ep.transpose(1, 2).unsqueeze(-1) * qp.to(acc)).to(q.dtype)
            _, _, dk_e = ks.backward(eq, qp, kp, vp, op, lse_k[:, :, rows], p.causal, softmax_scale)
            grads.dk.append(GradPart(p.k0, _sum_groups(dk_e, hkv), softmax_scale))
    return grads


def fused_block_backward(ks: _KernelSet, dout, q, k, v, out, lse, delta, *, dq_acc, dk_acc, dv_acc, **block) -> None:
    """The block-op backward (see `ringlse.blockop`): `fused_block_parts` added into the accumulators."""
    grads = fused_block_parts(ks, dout, q, k, v, out, lse, delta, **block)
    for acc, parts in zip((dq_acc, dk_acc, dv_acc), grads):
        add_parts(acc, parts)


def fused_block_op(name: str, ks: _KernelSet) -> BlockOp:
    """The block op (forward, accumulating backward, `forward_parts`, `backward_parts`) of a family of
    fused kernels."""
    return BlockOp(name, partial(fused_block_forward, ks), partial(fused_block_backward, ks), uses_delta=False,
                   backward_parts=partial(fused_block_parts, ks), forward_parts=partial(fused_block_states, ks))


SDPA_BLOCK_OP = fused_block_op("sdpa", SDPA_KERNELS)
