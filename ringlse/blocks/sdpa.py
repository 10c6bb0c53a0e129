"""The `sdpa` block op: PyTorch's fused attention kernels, which return the lse a ring needs.

Kernels, tried in this order on every call; the first that accepts the inputs runs (a warning names
each kernel that raised). Nothing is remembered between calls, so a kernel's choice depends on the
call's inputs alone and every rank of a ring with the same inputs runs the same kernel:

| name        | op (`torch.ops.aten.*`)                                   | dtypes          |
| ----------- | --------------------------------------------------------- | --------------- |
| `cudnn`     | `_scaled_dot_product_cudnn_attention` (+`_backward`)       | fp16, bf16      |
| `flash`     | `_scaled_dot_product_flash_attention` (+`_backward`)       | fp16, bf16      |
| `efficient` | `_scaled_dot_product_efficient_attention` (+`_backward`)   | fp16, bf16, fp32|

cuDNN is the fastest on H100/H200 (CONVENTIONS.md §9). On CUDA there is no silent fallback to an
`O(sq * sk)`-memory math kernel: when none of them accepts a call, it raises with every kernel's
reason. On CPU the op runs `flash_cpu` (`_scaled_dot_product_flash_attention_for_cpu`) then `math`
(`ringlse.blocks.torch_math`): the registry offers `sdpa` on CUDA only, but the CPU kernels let every
line of this module be tested without a GPU.

The ops know "no mask" and "top-left causal" only, on as many K/V heads as Q heads: the driver of
`ringlse.blocks.fused` cuts causal blocks at global offsets into top-left pieces
(`masks.split_causal_block_top_left`), repeats K/V for GQA and adds the lse-gradient term. PyTorch's
CUDA flash kernel aligns a non-square causal mask bottom-right (measured, torch 2.11), so it gets
top-left pieces of other shapes as squares plus full rectangles. The lse is normalised to `[b, h, sq]`
float32 (cuDNN returns `[b, h, sq, 1]` in some torch versions, efficient attention pads `sq` to a
multiple of 32); an empty row is `-inf`, never `+inf`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache

import torch

from ringlse.blocks.fused import KernelSet, fused_block_op, norm_lse
from ringlse.blocks.torch_math import torch_block_backward, torch_block_forward
from ringlse.checks import lse_dtype
from ringlse.masks import split_causal_block_top_left

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
    return _bhsd(r[0]), norm_lse(r[1], q.shape[1])


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
    return _bhsd(r[0]), norm_lse(r[1], q.shape[1])


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
    return _bhsd(r[0]), norm_lse(r[1], q.shape[1])


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
    return _bhsd(out), norm_lse(lse, q.shape[1])


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
# no "math" on CUDA: a silent fallback to O(sq * sk) memory is worse than an error that says why
_DEFAULT_ORDER = {"cuda": ("cudnn", "flash", "efficient"), "cpu": ("flash_cpu", "math")}


@dataclass
class _State:
    order: tuple[str, ...] | None = None  # set by use_kernels()
    last_used: dict[str, str] = field(default_factory=dict)  # what served the latest calls, for tests


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
    """Run `phase` ("forward"/"backward") on the first kernel that accepts this call's inputs.

    Decided per call: a kernel that raised is asked again next call (a process-wide ban after one
    error let one rank of a ring switch kernels for good while the others did not)."""
    order = _STATE.order or _DEFAULT_ORDER.get(q.device.type, ("math",))
    errors = []
    for name in order:
        kernel = KERNELS[name]
        if q.dtype not in kernel.dtypes:
            continue
        try:
            result = getattr(kernel, phase)(*args)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, AttributeError, NotImplementedError) as err:
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
    raise RuntimeError(
        f"ringlse sdpa: no kernel among {order} accepts {phase} for {q.dtype}, head dim {q.shape[-1]} on "
        f"{q.device}: {errors or 'dtype not supported'}; another backend may serve (ringlse.available_backends)"
    )


SDPA_KERNELS = KernelSet(
    forward=lambda q, k, v, causal, scale: _run("forward", q, q, k, v, causal, scale),
    backward=lambda dout, q, k, v, out, lse, causal, scale: _run("backward", q, dout, q, k, v, out, lse, causal, scale),
    native_gqa=False,
    causal_pieces=split_causal_block_top_left,
)


SDPA_BLOCK_OP = fused_block_op("sdpa", SDPA_KERNELS)
