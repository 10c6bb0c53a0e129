"""Gluon operations the Hopper kernels share: a tile in shared memory scaled in place, an opaque zero, and
what Triton 3.6 does not wrap for sm_90: TMA reduce-adds (from registers or from shared memory) and the
turns that put the adds of different programs to the same tile in a fixed order (an int32 in global
memory that each program waits to reach, then raises), which keeps float32 sums bitwise reproducible.

A turn waits only on programs started earlier: blocks start in grid order, so a program may wait on a
lower block index, never on a higher one (a program waiting on one that cannot start would hang).
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared


@gl._core.builtin
def tma_add(desc, coord, value, _semantic=None):
    """Add a register tile into global memory through TMA (`cp.reduce.async.bulk.tensor` add): Triton's
    `tt.descriptor_reduce`, which Gluon's TMA lowering stages through shared memory, but Gluon 3.6 does not
    wrap for Hopper. Each element gets one float32 add (deterministic); a load, add and store may fuse
    the scale into its add, so the two can differ in the last bit."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_descriptor_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, value.handle, coord)


@gl._core.builtin
def tma_add_from_smem(desc, coord, src, _semantic=None):
    """Add a shared-memory tile into global memory through TMA (`cp.reduce.async.bulk.tensor` add), the
    op Gluon 3.6 has (`async_tma_reduce`) but does not wrap for Hopper; completion is awaited separately."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def wait_turn(sem_ptr, turn):
    """Spin until the int32 at `sem_ptr` is at least `turn` (acquire: what was added before it was raised
    is visible after)."""
    seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [sem_ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)
    while seen < turn:
        seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [sem_ptr],
                                         dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def pass_turn(sem_ptr, turn):
    """Wait until this thread's TMA adds have completed (written, not only read from shared memory: the
    next program's add must land after them), then raise the int32 at `sem_ptr` to at least `turn` (one
    lane of the calling warp, release; a maximum, so a turn never goes back). Call it from a one-warp
    partition, after the add."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 l; cp.async.bulk.wait_group 0; bar.warp.sync -1; mov.u32 l, %laneid; "
        "setp.eq.u32 p, l, 0; @p red.release.gpu.global.max.s32 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [sem_ptr, turn], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def opaque_zero(x):
    """An int32 0 that the compilers cannot see through (one move per call, `x` only orders it): an index
    plus it keeps a loop-invariant shared-memory descriptor from being hoisted out of the loop, so that it
    is rebuilt where it is used instead of held, or spilled, across the loop."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def scale_smem(buf, factor):
    """Multiply a `[rows, cols]` shared-memory tile by `factor` in place (rounded back to its dtype) and
    make the result visible to the tensor cores' reads. With a softcap, Q (forward) or K (dk/dv) scaled once
    by scale / softcap makes each dot tanh's argument as it leaves the tensor cores: one multiply per Q or
    K element of a work tile instead of one per score."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # (a consumer warpgroup)
    buf.store((buf.load(layout).to(gl.float32) * factor).to(buf.dtype))
    fence_async_shared()
