"""Block ops: the contract (`ringlse.blocks.contract`), one module per backend, and this registry.

| name     | module                          | what                                                          |
| -------- | ------------------------------- | ------------------------------------------------------------- |
| `triton` | `ringlse.blocks.triton_kernels` | ringlse's Triton kernels (`ringlse.kernels`)                  |
| `sdpa`   | `ringlse.blocks.sdpa`           | PyTorch's fused attention ops (cuDNN, flash, ...)             |
| `flash`  | (`fa4` or `fa2`)                | the best FlashAttention installed: `fa4` on sm90+, else `fa2` |
| `fa4`    | `ringlse.blocks.fa4`            | FlashAttention-4 (`flash_attn.cute`, flash-attn-4), sm90+     |
| `fa2`    | `ringlse.blocks.flash`          | the flash-attn 2 package, sm80+                               |
| `torch`  | `ringlse.blocks.torch_math`     | PyTorch math, any device and dtype                            |

A backend module is imported only when its op is asked for (`ringlse.blocks.fa4`, which imports
without FlashAttention-4, also when the registry asks whether FA4 can run), so `import ringlse` needs
neither Triton nor a GPU. A FlashAttention package is imported the first time the registry asks about it.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache

import torch

from ringlse.blocks.contract import BlockOp
from ringlse.checks import SOFTCAP_BACKENDS, V_HEAD_DIM_BACKENDS, feature_refused
from ringlse.kernel_import import have_triton, interpreting

_HALF = (torch.bfloat16, torch.float16)
# name -> (module, attribute holding the BlockOp, dtypes it computes, whether it takes intervals:
# windows and documents; the op's own `takes_intervals` says the same, and a test checks they agree)
_BACKENDS: dict[str, tuple[str, str, tuple[torch.dtype, ...], bool]] = {
    "triton": ("ringlse.blocks.triton_kernels", "TRITON_BLOCK_OP", (*_HALF, torch.float32), True),
    "sdpa": ("ringlse.blocks.sdpa", "SDPA_BLOCK_OP", (*_HALF, torch.float32), False),
    # the best of _FLASH_ORDER that can run (get_block_op returns that one's op; the entry's own op
    # is fa2's under its former name)
    "flash": ("ringlse.blocks.flash", "FLASH_BLOCK_OP", _HALF, False),
    "fa4": ("ringlse.blocks.fa4", "FA4_BLOCK_OP", _HALF, False),
    "fa2": ("ringlse.blocks.flash", "FA2_BLOCK_OP", _HALF, False),
    "torch": ("ringlse.blocks.torch_math", "TORCH_BLOCK_OP", (*_HALF, torch.float32, torch.float64), True),
}
# what `auto` takes on CUDA, first that can run the call: fastest first where measured (fp16/bf16 on
# sm90, H100 and H200 alike: FA4 611-655 / 552-625 TFLOP/s forward / backward, cuDNN through sdpa
# 563-616 / 526-548, ours 480-492 / 362-392, hd 128; the cuDNN ring 0.75x PyTorch CP's time where the
# triton ring took 1.03x; `benchmarks/RESULTS.md`)
_AUTO_MEASURED = {(9, 0): ("fa4", "sdpa", "triton", "torch")}
# with a softcap in bf16 and one head dim, sm90: the triton kernels' capped forward took 0.50-0.53x FA4's
# capped time and forward+backward 0.57-0.84x (H100, S 8K/32K)
_AUTO_MEASURED_SOFTCAP = {(9, 0): ("triton", "fa4", "torch")}
_AUTO_CUDA = ("triton", "sdpa", "torch")
# backends whose ops take windows as a rule (`Masks.WINDOW`) besides those taking intervals
_TAKES_WINDOW = ("fa4",)
# what `flash` stands for, best first
_FLASH_ORDER = ("fa4", "fa2")
# the GPU each FlashAttention needs (compute capability)
_MIN_CAPABILITY = {"fa4": (9, 0), "fa2": (8, 0)}


@cache
def _flash_attn_2_missing() -> str | None:
    """Why flash-attn 2's interface cannot be used, or None (imported once, on first ask)."""
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError as err:
        cute = _has_module("flash_attn") and _has_module("flash_attn.cute")
        extra = " (FlashAttention-4, flash_attn.cute, is installed: that is backend 'fa4')" if cute else ""
        return f"flash-attn 2 is not installed: {err}{extra}"
    return None


def _fa4_missing() -> str | None:
    """Why FlashAttention-4's interface cannot be used, or None (imported once, on first ask)."""
    return importlib.import_module("ringlse.blocks.fa4").interface_missing()


def _capability(device: torch.device) -> tuple[int, int] | str:
    """The GPU's compute capability, or why it cannot be read."""
    try:
        return tuple(torch.cuda.get_device_capability(device))
    except Exception as err:  # torch without CUDA, no such device
        return f"cannot read the GPU's compute capability: {type(err).__name__}: {err}"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def auto_candidates(capability: tuple[int, int] | None, dtype: torch.dtype | None, masked: bool = False,
                    softcap: bool = False) -> tuple[str, ...]:
    """The backends `auto` tries, in order, on a CUDA GPU of `capability` (None: not CUDA) for
    inputs of `dtype`: the measured order on GPUs we measured (fp16/bf16 on sm90: `fa4`, `sdpa`,
    `triton`; bf16 with `softcap`, a logit softcap and one head dim for Q/K and V: `triton`, `fa4`), else
    `triton`, `sdpa`; `torch` last. Windows and documents (`masked`) need intervals, which only `triton`
    and `torch` take (the first that can run the call wins)."""
    if capability is None:
        return ("torch",)
    order = _AUTO_CUDA
    if dtype in _HALF:
        order = _AUTO_MEASURED.get(tuple(capability[:1]) + (0,), _AUTO_CUDA)
    if softcap and dtype == torch.bfloat16:
        order = _AUTO_MEASURED_SOFTCAP.get(tuple(capability[:1]) + (0,), order)
    return tuple(n for n in order if not masked or _BACKENDS[n][3])


def backend_unavailable_reason(name: str, device: torch.device | str, dtype: torch.dtype | None = None,
                               masked: bool = False, head_dim: int | None = None, window: bool = False, *,
                               softcap: float = 0.0, v_head_dim: int | None = None) -> str | None:
    """Why backend `name` cannot run on `device` (with inputs of `dtype` and `head_dim`, if given;
    with windows or documents as intervals if `masked`; with a window, as intervals or as a rule, if
    `window`; with logit softcapping if `softcap` > 0; with V head dim `v_head_dim` if it differs from
    `head_dim`), or None."""
    if name not in _BACKENDS:
        return f"unknown backend {name!r}"
    if softcap and name not in SOFTCAP_BACKENDS:
        return (f"softcap {softcap:g}: {name} does not take softcap "
                f"(backends that take it: {', '.join(SOFTCAP_BACKENDS)})")
    if v_head_dim is not None and head_dim is not None and v_head_dim != head_dim and name not in V_HEAD_DIM_BACKENDS:
        return (f"V head dim {v_head_dim} differs from Q/K head dim {head_dim}: {name} does not take it "
                f"(backends that take it: {', '.join(V_HEAD_DIM_BACKENDS)})")
    if window and not masked and name != "flash" and not (_BACKENDS[name][3] or name in _TAKES_WINDOW):
        takers = [n for n, entry in _BACKENDS.items() if entry[3] or n in _TAKES_WINDOW]
        return f"{name} does not take windows (backends that do: {', '.join(takers)})"
    if name == "fa4" and head_dim is not None:
        refused = importlib.import_module("ringlse.blocks.fa4").head_dim_refused(head_dim, v_head_dim)
        if refused is not None:
            return refused
    if name == "fa2" and head_dim is not None and head_dim > 256:
        return f"fa2 takes head dims up to 256, got {head_dim}"
    device = torch.device(device)
    if masked and not _BACKENDS[name][3]:
        takers = [n for n, entry in _BACKENDS.items() if entry[3]]
        return f"{name} does not take windows or documents here (backends that do: {', '.join(takers)})"
    if dtype is not None and dtype not in _BACKENDS[name][2]:
        return f"{name} does not compute {dtype} (it takes {', '.join(str(d) for d in _BACKENDS[name][2])})"
    if name == "torch":
        return None
    if name == "triton":
        if not have_triton():
            return "triton is not installed"
        if device.type != "cuda" and not interpreting():
            return "triton needs a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)"
        return None
    if device.type != "cuda":
        return f"{name} needs a CUDA device"
    if name == "flash":
        reasons = [(n, backend_unavailable_reason(n, device, dtype, masked, head_dim, window)) for n in _FLASH_ORDER]
        if any(r is None for _, r in reasons):
            return None
        return "no FlashAttention can run here: " + "; ".join(f"{n}: {r}" for n, r in reasons)
    if name in _MIN_CAPABILITY:
        missing = _fa4_missing() if name == "fa4" else _flash_attn_2_missing()
        if missing is not None:
            return missing
        cap, need = _capability(device), _MIN_CAPABILITY[name]
        if isinstance(cap, str):
            return cap
        if cap < need:
            what = "FlashAttention-4" if name == "fa4" else "flash-attn 2"
            return f"{what} needs an sm{need[0]}{need[1]} or newer GPU, this one is sm{cap[0]}{cap[1]}"
    return None


def available_backends(device: torch.device | str, dtype: torch.dtype | None = None, masked: bool = False,
                       head_dim: int | None = None, window: bool = False, **features) -> list[str]:
    """Names of the backends that can run on `device` (for inputs of `dtype` and `head_dim`, if
    given; taking windows and documents as intervals, if `masked`; taking a window, if `window`)."""
    return [n for n in _BACKENDS
            if backend_unavailable_reason(n, device, dtype, masked, head_dim, window, **features) is None]


def get_block_op(backend: str | BlockOp, device: torch.device | str, dtype: torch.dtype | None = None,
                 masked: bool = False, head_dim: int | None = None, window: bool = False, *,
                 softcap: float = 0.0, v_head_dim: int | None = None) -> BlockOp:
    """The block op for `backend` on `device` and inputs of `dtype` and `head_dim`. `auto` is the
    first of `auto_candidates` that can run the call: on an sm90 GPU (H100, H200) with fp16/bf16,
    `fa4` where FlashAttention-4 is installed, else `sdpa` (cuDNN), else `triton` (bf16 with a `softcap`
    and one head dim: `triton`, then `fa4`); on other GPUs
    `triton`, then `sdpa`; with `masked` (windows, documents as intervals) `triton`; `torch` on the
    CPU and for float64. `flash` is `fa4`'s op where FlashAttention-4 imports and the GPU is sm90 or
    newer, else `fa2`'s. A `BlockOp` is returned as it is (your own kernels, or a registry op on a
    device it is not offered for, such as `sdpa`'s CPU kernels in tests; it too is refused for a
    `softcap` > 0 or a `v_head_dim` other than `head_dim` its `Capabilities` do not take). With either,
    only `SOFTCAP_BACKENDS` / `V_HEAD_DIM_BACKENDS` (`torch`, `triton`, `fa4`) qualify, `auto` included.

    Raises:
        ValueError: unknown or unavailable backend, or one that does not compute `dtype`; the
            message lists what is available.
        TypeError: `backend` is neither a name nor a `BlockOp`.
    """
    features = dict(softcap=softcap, v_head_dim=v_head_dim)
    if isinstance(backend, BlockOp):
        why = feature_refused(backend.name, backend.caps, softcap, head_dim or 0, v_head_dim or head_dim or 0)
        if why is not None:
            raise ValueError(why)
        return backend
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name or a BlockOp, got {type(backend).__name__}")
    device = torch.device(device)
    if backend == "auto":
        cap = _capability(device) if device.type == "cuda" else None
        one_head_dim = v_head_dim is None or v_head_dim == head_dim
        candidates = auto_candidates(None if isinstance(cap, str) else cap, dtype, masked,
                                     softcap=bool(softcap) and one_head_dim)
        name = next((n for n in candidates
                     if backend_unavailable_reason(n, device, dtype, masked, head_dim, window, **features) is None),
                    "torch")
    else:
        name = backend
    reason = backend_unavailable_reason(name, device, dtype, masked, head_dim, window, **features)
    if reason is not None:
        raise ValueError(
            f"backend {backend!r} is not available on {device.type}"
            + (f" for {dtype}" if dtype is not None else "")
            + f": {reason}; available here: {available_backends(device, dtype, masked, head_dim, window, **features)}"
            " (or 'auto')"
        )
    if name == "flash":  # the best FlashAttention that can run
        name = next(n for n in _FLASH_ORDER
                    if backend_unavailable_reason(n, device, dtype, masked, head_dim, window, **features) is None)
    module, attr, _, _ = _BACKENDS[name]
    return getattr(importlib.import_module(module), attr)


__all__ = ["BlockOp", "auto_candidates", "available_backends", "backend_unavailable_reason", "get_block_op"]
