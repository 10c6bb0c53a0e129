"""Integer helpers for the launchers (host code).

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in Triton 3.x: called from Python
they go through the JIT's constexpr wrapping and cost ~5 us of host time each (measured with Triton
3.6), and a launcher calls several. For inputs whose kernels take a few microseconds that host time
is the whole cost of a call, so the launchers use these plain versions (~0.05 us).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
