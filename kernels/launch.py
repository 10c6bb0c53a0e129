"""Kernel launches with less host time than `kernel[grid](...)`.

Why: for small inputs a launcher's host time is the whole cost of a call. `JITFunction.run` (what
`kernel[grid](...)` calls) binds the arguments to the signature, specialises every one of them, builds
its cache key and launch metadata: ~20 us per launch with Triton 3.6 on an H200, while the kernels of
a small softmax run for a few. `launch` keeps its own cache of compiled kernels under a key of the same
specialisation features, computed in plain Python, and on a hit calls the compiled kernel's launcher
directly, the very call `JITFunction.run` ends with.

`BoundLaunch` goes further for the launches a call plan repeats: the arguments that stay are fixed
once, a call keys only the ones it passes, and the compiled launcher's C function gets the tensors'
pointers as integers (H200 host, an empty kernel of five tensor arguments: 7.9 us a launch, 11.7
through `launch`; of one tensor, ~16 through `kernel[grid]`).

Kernels that take TMA descriptors (the Hopper attention kernels) get them as `TmaDesc`s: `launch` keys
a descriptor by what Triton specialises it on, and on a hit hands the compiled launcher's C function the
descriptor's tensor map from a cache keyed by its contents (address, shape, strides, box, swizzle), so
that neither a `TensorDescriptor` (its checks) nor a tensor map (a driver call) is built per launch: a
ring reuses its K/V buffers, a layer its Q.

Every case it does not know to be safe takes Triton's own path: the interpreter (CPU), tensors not on
a CUDA device, launch hooks set (profilers), pre-run hooks, argument types other than tensors, `TmaDesc`s,
ints, floats, bools and None, constexprs passed positionally, and a Triton other than 3.6, whose launcher
internals these paths do not know (`FAST_PATH`). Not re-checked on a hit (Triton does on every launch):
that the constexpr globals a kernel reads kept their values, and a kernel's source patched at run time
(`_unsafe_update_src`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import triton

try:
    from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg
except ImportError:  # no CUDA backend: every launch takes Triton's path
    _make_tensordesc_arg = None
try:
    from triton import knobs as _knobs
    from triton.knobs import HookChain as _HookChain
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # an older Triton without knobs: every launch takes Triton's own path
    _knobs = None
    _HookChain = None
    _JITFunction = None

_STREAM_GETTER = getattr(torch._C, "_cuda_getCurrentRawStream", None)

FAST_ABI = (3, 6)  # the Triton (major, minor) whose launcher internals the fast paths call directly


def fast_path_supported(version: str) -> bool:
    """Whether a Triton of this version string has the launcher internals `launch` and `BoundLaunch`
    call directly (3.6's: the compiled launcher's C function and its argument order)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and (int(m[1]), int(m[2])) == FAST_ABI


# True: `launch` and `BoundLaunch` call Triton 3.6's compiled launchers directly where they can. False
# (another Triton; or set by a test, read at every launch): every launch is Triton's own
# `kernel[grid](...)`, through the same interface
FAST_PATH = _knobs is not None and _JITFunction is not None and fast_path_supported(triton.__version__)

_MAX_ENTRIES = 4096  # distinct (kernel, specialisation) pairs kept; the cache starts over past this
# key -> (run, function, packed_metadata, constexpr names, kernel), or None: that key always takes
# Triton's path. The entry keeps the kernel alive, so its id (in the key) is not reused while cached;
# a reused id could only meet a None entry, which sends it to Triton's path: safe.
_CACHE: dict[tuple, tuple | None] = {}
_MISSING = object()


class TmaDesc(NamedTuple):
    """A TMA descriptor's parts, passed to `launch` in a descriptor argument's place: Triton's path gets
    the `TensorDescriptor` they make; the fast path only the tensor map, cached (see the module's docstring).

    `base` is the tensor, `shape`/`strides` the matrix TMA indexes (elements), `block` its box, `layout`
    the box's `NVMMASharedLayout`."""

    base: torch.Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block: tuple[int, ...]
    layout: Any
    padding: str = "zero"

    def descriptor(self):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block), self.layout,
                                self.padding)


def _tritons_args(args: tuple) -> tuple:
    return tuple(a.descriptor() if type(a) is TmaDesc else a for a in args)


_MAX_TENSOR_MAPS = 1024  # tensor maps kept; the cache starts over past this
# (address, shape, strides, the compiled kernel's descriptor metadata) -> the launcher's arguments
_TENSOR_MAPS: dict[tuple, list] = {}


def _tensor_map_args(desc: TmaDesc, meta: dict) -> list:
    """The C launcher's arguments for `desc` (its tensor map, shape and strides), built by Triton's own
    encoder once per content: a tensor map holds nothing but what the key holds."""
    key = (desc.base.data_ptr(), desc.shape, desc.strides, desc.padding, meta["swizzle"], meta["elem_size"],
           meta["elem_type"], tuple(meta["block_size"]), meta["fp4_padded"])
    got = _TENSOR_MAPS.get(key)
    if got is None:
        if len(_TENSOR_MAPS) >= _MAX_TENSOR_MAPS:
            _TENSOR_MAPS.clear()
        got = _TENSOR_MAPS[key] = _make_tensordesc_arg(desc, meta)
    return got


def current_raw_stream(index: int | None) -> int:
    """The current CUDA stream's handle. `torch.cuda.current_stream()` builds a Stream object (several
    us of host time per call); the raw getter, which Triton's own launcher uses, does not.

    Args:
        index: CUDA device index; None for the current device.

    Returns:
        the raw `cudaStream_t` as an int.
    """
    if _STREAM_GETTER is None:
        return torch.cuda.current_stream(index).cuda_stream
    return _STREAM_GETTER(torch.cuda.current_device() if index is None else index)


def _spec(arg) -> tuple | None:
    """Specialisation features of one positional argument, at least as fine as Triton 3.6's.

    Triton compiles apart: integers equal to 1 (made constants), integers divisible by 16, int32 /
    int64 / uint64 integers, and tensors by dtype and 16-byte alignment of their pointer. A feature
    coarser than Triton's would launch a kernel compiled for other arguments (a silent bug); a finer
    one only costs a cache entry (`launch` keys integers by their value, finer still, and cheaper to
    compute). `is_cuda` marks the tensors whose keys must take Triton's path.

    Args:
        arg: a positional kernel argument.

    Returns:
        a hashable tuple of features, or None for a type that `launch` leaves to Triton.
    """
    if isinstance(arg, torch.Tensor):  # (first: after integers, which `launch` keys apart, the most common)
        return (arg.dtype, arg.data_ptr() % 16 == 0, arg.is_cuda)
    if type(arg) is TmaDesc:
        # Triton specialises a descriptor on its type (dtype, box, layout); shape and stride features,
        # alignment and device are finer (a misaligned base then misses, and Triton's path checks it)
        return ("tma", arg.base.dtype, arg.base.data_ptr() % 16 == 0, arg.base.is_cuda, arg.block, arg.layout,
                arg.padding, tuple(x % 16 == 0 for x in arg.shape), tuple(x % 16 == 0 for x in arg.strides))
    t = type(arg)
    if t is bool:  # (before int: bool is an int subclass; `type(arg) is int` excludes it anyway)
        return ("b",)
    if t is int:
        return (arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31, -2**63 <= arg < 2**63)
    if t is float:
        return ("f",)
    if arg is None:
        return ("none",)
    return None


def _hook_idle(hook) -> bool:
    # Triton 3.6 keeps an empty HookChain where no hook is set (older ones kept None): calling it does
    # nothing, so the launcher may be given None instead, and no launch metadata is needed
    return hook is None or (type(hook) is _HookChain and not hook.calls)


def _fast_path_on(kernel) -> bool:
    """False where every launch must take Triton's path (interpreter, hooks, another Triton)."""
    # (the interpreter's kernels, under TRITON_INTERPRET=1, are not JITFunctions)
    if not FAST_PATH or _STREAM_GETTER is None or not isinstance(kernel, _JITFunction):
        return False
    runtime = _knobs.runtime
    if not (_hook_idle(runtime.launch_enter_hook) and _hook_idle(runtime.launch_exit_hook)):
        return False
    # pre-run hooks run on every launch
    return not getattr(kernel, "pre_run_hooks", True)


def _build_entry(kernel, grid: tuple[int, ...], args: tuple, num_warps: int, consts: dict):
    """Compile (or fetch from Triton's cache) the kernel for these arguments and return its cache entry;
    None where this key must always take Triton's path; `_MISSING` where only this call must (a compile
    hook that skipped the compile, an asynchronous compile: nothing is cached)."""
    if any(s is None for s in map(_spec, args)):
        return None
    if any(isinstance(a, torch.Tensor) and not a.is_cuda for a in args):
        return None
    descs = [i for i, a in enumerate(args) if type(a) is TmaDesc]
    if descs and (_make_tensordesc_arg is None or any(not args[i].base.is_cuda for i in descs)):
        return None
    try:
        params = kernel.params
        n = len(args)
        # the launcher takes every parameter in signature order: the positional ones must be runtime
        # arguments (a positional constexpr's value is not in the key), and the rest constexprs given
        # by keyword (a runtime argument given by keyword would not be specialised by the key)
        if n > len(params) or any(p.is_constexpr for p in params[:n]):
            return None
        names = tuple(kernel.arg_names[n:])
        if not all(p.is_constexpr for p in params[n:]) or not all(name in consts for name in names):
            return None
    except AttributeError:
        return None
    compiled = kernel.warmup(*_tritons_args(args), grid=grid, num_warps=num_warps, **consts)
    if compiled is None or hasattr(compiled, "result"):
        return _MISSING
    try:
        run = compiled.run  # (a property: loads the binary onto the current device)
        tma = _tma_launcher(run, compiled, len(descs)) if descs else None
        if descs and tma is None:
            return None
        return run, compiled.function, compiled.packed_metadata, names, kernel, tma
    except AttributeError:
        return None


def _tma_launcher(run, compiled, n_descs: int) -> tuple | None:
    """`(C launch function, its arguments before the kernel's, each descriptor's metadata)` of a compiled
    kernel taking TMA descriptors, or None (Triton's path) where it is not as Triton 3.6 builds it: the
    C function is the one Triton's descriptor wrapper closes over, and the kernel uses no scratch memory."""
    metas = getattr(compiled.metadata, "tensordesc_meta", None)
    if not metas or len(metas) != n_descs or any(m is None for m in metas):
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    cells = getattr(getattr(run, "launch", None), "__closure__", None) or ()
    c = [x.cell_contents for x in cells
         if callable(x.cell_contents) and getattr(x.cell_contents, "__name__", "") == "launch"]
    if len(c) != 1:
        return None
    head = (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata, None, None, None)
    return c[0], head, tuple(metas)


def launch(kernel, grid: tuple[int, ...], *args, num_warps: int, **consts) -> None:
    """`kernel[grid](*args, num_warps=num_warps, **consts)`, without Triton's binder on a warm path.

    Args:
        kernel: a `@triton.jit` function.
        grid: 1 to 3 program counts.
        *args: the kernel's runtime arguments, positionally, in signature order (a TMA descriptor as a
            `TmaDesc`).
        num_warps: warps per program.
        **consts: the constexpr parameters (by keyword), and any other launch option.

    Returns:
        None; the kernel is enqueued on the current CUDA stream, as Triton's launch does.
    """
    entry = None
    if _fast_path_on(kernel):
        device = torch.cuda.current_device()
        runtime = _knobs.runtime
        # consts: in call order (finer than sorted, and cheaper) and with their types (1 == 1.0 == True);
        # integer arguments by value (finer than their features, and a quarter of the host time)
        key = (id(kernel), num_warps, tuple(consts.items()), tuple(map(type, consts.values())), device,
               runtime.debug, _knobs.compilation.instrumentation_mode,
               *[a if type(a) is int else _spec(a) for a in args])
        try:
            entry = _CACHE.get(key, _MISSING)
        except TypeError:  # an unhashable constexpr value: Triton's path
            entry = None
        if entry is _MISSING:
            entry = _build_entry(kernel, grid, args, num_warps, consts)
            if entry is not _MISSING:
                if len(_CACHE) >= _MAX_ENTRIES:
                    _CACHE.clear()
                _CACHE[key] = entry
            else:
                entry = None
    if entry is None:
        kernel[grid](*_tritons_args(args), num_warps=num_warps, **consts)
        return
    run, function, metadata, names, _, tma = entry
    g0, g1, g2 = (*grid, 1, 1)[:3]
    if tma is None:
        # launch metadata, enter hook, exit hook: all None while no hook is set
        run(g0, g1, g2, _STREAM_GETTER(device), function, metadata, None, None, None, *args, *map(consts.get, names))
        return
    c, head, metas = tma
    flat, j = [], 0
    for a in args:
        if type(a) is TmaDesc:
            flat.extend(_tensor_map_args(a, metas[j]))
            j += 1
        else:
            flat.append(a)
    c(g0, g1, g2, _STREAM_GETTER(device), function, *head, *flat, *map(consts.get, names))


class _Free:
    def __repr__(self) -> str:
        return "FREE"


FREE = _Free()  # marks the arguments of a `BoundLaunch` that each call passes


class BoundLaunch:
    """A launch that a call plan makes again and again: `launch(kernel, grid, *args, num_warps=...,
    **consts)` with the grid, the constexprs and the arguments that stay fixed at plan time, called
    with the others (`FREE` in `args`, passed per call in their order: tensors, or integers).

    Why: `launch` builds a key of every argument on each call, and Triton's launcher asks the driver
    about every tensor's pointer; for a few-MB input that host time is most of a call. Here the fixed
    arguments are taken once; a call keys its free arguments only (a tensor's dtype and 16-byte
    alignment, an integer's features as Triton specialises them, the device) and hands the compiled
    kernel's launcher the tensors' pointers, as integers (the module's docstring has the host times).
    Fixed arguments may not be tensors (a plan holds no tensor).

    Every case `launch` leaves to Triton is left to it here too (then with the tensors themselves),
    and so are tensors not on a CUDA device. One hazard it shares with `launch`: a kernel's source or
    the constexpr globals it reads changed at run time are not seen once cached.
    """

    __slots__ = ("kernel", "grid", "args", "num_warps", "consts", "free", "entries", "jit")

    def __init__(self, kernel, grid: tuple[int, ...], *args, num_warps: int, **consts):
        if any(isinstance(a, (torch.Tensor, TmaDesc)) for a in args):
            raise TypeError("BoundLaunch: tensors are per-call arguments (FREE), not fixed ones; no TMA descriptors")
        self.kernel, self.grid, self.args, self.num_warps, self.consts = kernel, tuple(grid), args, num_warps, consts
        self.free = tuple(i for i, a in enumerate(args) if a is FREE)
        # key -> (launcher, function, the launcher's arguments before the kernel's, the kernel's with the
        # free ones to put in), or None: Triton's path
        self.entries: dict[tuple, tuple | None] = {}
        # (the interpreter's kernels are not JITFunctions: under TRITON_INTERPRET=1 every call is Triton's)
        self.jit = _JITFunction is not None and _STREAM_GETTER is not None and isinstance(kernel, _JITFunction)

    def _full(self, free: tuple) -> list:
        args = list(self.args)
        for i, v in zip(self.free, free):
            args[i] = v
        return args

    def _tritons_path(self, free: tuple) -> None:
        launch(self.kernel, self.grid, *self._full(free), num_warps=self.num_warps, **self.consts)

    def __call__(self, *free) -> None:
        runtime = _knobs.runtime if self.jit and FAST_PATH else None
        if runtime is None or self.kernel.pre_run_hooks or not (
            _hook_idle(runtime.launch_enter_hook) and _hook_idle(runtime.launch_exit_hook)
        ):
            self._tritons_path(free)
            return
        values, key = [], [runtime.debug, _knobs.compilation.instrumentation_mode]
        for v in free:
            if type(v) is int:
                values.append(v)
                key.append((v == 1, v % 16 == 0, -2**31 <= v < 2**31, -2**63 <= v < 2**63))
            elif type(v) is torch.Tensor and v.is_cuda:  # (a subclass may carry its own pointer rules)
                p = v.data_ptr()
                values.append(p)
                key.append((v.dtype, p % 16 == 0))
            else:
                self._tritons_path(free)
                return
        device = torch.cuda.current_device()
        key.append(device)
        key = tuple(key)
        entry = self.entries.get(key, _MISSING)
        if entry is _MISSING:
            entry = self._entry(key, free)
        if entry is None:
            self._tritons_path(free)
            return
        launcher, function, head, args = entry
        args = args.copy()
        for i, v in zip(self.free, values):
            args[i] = v
        g0, g1, g2 = (*self.grid, 1, 1)[:3]
        launcher(g0, g1, g2, _STREAM_GETTER(device), function, *head, *args)

    def _entry(self, key: tuple, free: tuple):
        """The cache entry of `key` (built from this call's arguments), or None: Triton's path."""
        args = self._full(free)
        built = _build_entry(self.kernel, self.grid, tuple(args), self.num_warps, self.consts)
        if built is _MISSING:  # (only this call takes Triton's path)
            return None
        entry = None
        if built is not None:
            run, function, metadata, names, _, _ = built
            args = list(self.args) + [self.consts[n] for n in names]
            # the compiled launcher's C function where Triton's Python wrapper would only add scratch
            # buffers this kernel does not use; else the wrapper
            c = getattr(run, "launch", None)
            if c is not None and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0:
                head = (run.launch_cooperative_grid, run.launch_pdl, None, None, metadata, None, None, None)
                entry = (c, function, head, args)
            else:
                entry = (run, function, (metadata, None, None, None), args)
        if len(self.entries) >= 64:
            self.entries.clear()
        self.entries[key] = entry
        return entry


class Launched(NamedTuple):
    """A launch `recorded_launches` saw."""

    kernel: str  # the kernel's name
    grid: tuple[int, ...]
    num_warps: int
    consts: dict  # constexprs and launch options (maxnreg, launch_cooperative_grid)


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launched]]:
    """The launches that `BoundLaunch`es make inside the block, in order (tests and benchmarks: which
    kernels a call runs, with which constexprs). Not thread-safe: it replaces `BoundLaunch.__call__`
    for the block, and costs nothing outside one."""
    seen: list[Launched] = []
    real = BoundLaunch.__call__

    def recorded(bound: BoundLaunch, *free) -> None:
        seen.append(Launched(bound.kernel.fn.__name__, bound.grid, bound.num_warps, bound.consts))
        return real(bound, *free)

    BoundLaunch.__call__ = recorded
    try:
        yield seen
    finally:
        BoundLaunch.__call__ = real
