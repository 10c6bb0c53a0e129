"""Host-side helpers for the launchers: integer arithmetic, the interpreter switch, TMA's row views,
the device queries they make on every call (read once per device).

Importable without Triton (as is `ringlse.kernels` itself), so that `ringlse` and the tests can ask
`interpreting()` before deciding whether to import a kernel.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in Triton 3.x: called from Python
they go through the JIT's constexpr wrapping and cost ~5 us of host time each (measured with Triton
3.6), and a launcher calls several. For inputs whose kernels take a few microseconds that host time
is the whole cost of a call, so the launchers use these plain versions (~0.05 us).
"""

from __future__ import annotations

import functools
import os

import torch

# the spellings of "true" Triton's own switch takes (`triton.knobs.runtime.interpret`, case-insensitive)
_TRUE = frozenset(("1", "true", "on", "yes", "y"))


def interpreting() -> bool:
    """True when Triton kernels run under its CPU interpreter (`TRITON_INTERPRET` set to a true value).

    The one reader of the variable for the kernels: it reads the environment on every call (tests set
    it before Triton is imported) and takes the same spellings of true as Triton's switch does.
    """
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def rows_view(t) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Shape and strides of a `[b, s, heads, d]` tensor seen as a `[b * s, heads * d]` matrix (what TMA
    descriptors index), or None when the strides do not allow it."""
    b, s, nh, d = t.shape
    if t.stride(3) != 1 or t.stride(2) != d or (b > 1 and t.stride(0) != s * t.stride(1)):
        return None
    return (b * s, nh * d), (t.stride(1), 1)


def tma_indexable(t) -> bool:
    """Whether TMA can index `[b, s, heads, d]` `t` as `[b * s, heads * d]` rows (16-byte aligned)."""
    view = rows_view(t)
    return view is not None and t.data_ptr() % 16 == 0 and (view[1][0] * t.element_size()) % 16 == 0


@functools.cache
def sm_count(device_index: int) -> int:
    """The SMs of CUDA device `device_index`, read once."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def device_capability(device_index: int) -> tuple[int, int]:
    """The compute capability of CUDA device `device_index`, read once: the launchers ask on every call,
    and a short ring call makes dozens of them."""
    return tuple(torch.cuda.get_device_capability(device_index))
