"""How many programs of a compiled kernel one SM holds at once (host code).

The cooperative softmax kernels (`softmax/coop_kernels.py`) spin on each other, so their grid must never exceed what the GPU
holds at once. The driver answers that exactly (`cuOccupancyMaxActiveBlocksPerMultiprocessor`, asked
through ctypes: no dependency beyond the driver that runs the kernel); where it cannot be asked, the
count follows the driver's rules, one of which is easy to miss: registers are allocated per warp from
the register file of one of the SM's four sub-partitions (schedulers), not from the SM's pool as a
whole. A kernel of 223 registers per thread (7168 per warp) fits 65536 // 7168 = 9 warps by the pool
but only 2 per sub-partition (16384 // 7168), 8 in all. Counting by the pool asked for more programs
than the driver places, it refused the cooperative launch, and the launcher fell back to half as many
rows in flight: bf16 softmax forward at 0.45x copy bandwidth instead of 0.72x (measured on H200).
"""

from __future__ import annotations

import ctypes
import functools

_SUB_PARTITIONS = 4  # schedulers per SM, each with a quarter of the register file (sm_70 and later)
_REG_UNIT = 256  # registers are allocated per warp in units of 256
_BLOCK_SMEM_RESERVED = 1024  # shared memory the driver reserves per block (sm_80 and later)
_MAX_BLOCKS = 32  # resident blocks per SM (sm_80 and later)


def blocks_per_sm_by_rules(n_regs: int, warps: int, shared: int, *, regs_per_sm: int = 65536,
                           threads_per_sm: int = 2048, smem_per_sm: int = 228 * 1024) -> int:
    """Blocks of `warps` warps, `n_regs` registers per thread and `shared` bytes of shared memory that
    one SM holds at once, by the driver's allocation rules."""
    regs_per_warp = -(-n_regs * 32 // _REG_UNIT) * _REG_UNIT
    warps_by_regs = (regs_per_sm // _SUB_PARTITIONS // regs_per_warp) * _SUB_PARTITIONS if regs_per_warp else 1 << 30
    by_regs = warps_by_regs // warps
    by_threads = threads_per_sm // (32 * warps)
    by_smem = smem_per_sm // (shared + _BLOCK_SMEM_RESERVED)
    return max(0, min(by_regs, by_threads, by_smem, _MAX_BLOCKS))


@functools.cache
def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def blocks_per_sm_by_driver(function: int, warps: int, shared: int) -> int | None:
    """The driver's count for a loaded kernel (`function`: its CUfunction handle, as Triton's compiled
    kernels hold it), or None where the driver cannot be asked."""
    lib = _libcuda()
    if lib is None or not function:
        return None
    n = ctypes.c_int(0)
    rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), ctypes.c_void_p(function), ctypes.c_int(32 * warps), ctypes.c_size_t(shared)
    )
    return n.value if rc == 0 else None
