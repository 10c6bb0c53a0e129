"""FlashAttention-4's calls replayed without its Python wrapper, once a call's signature repeats.

Why: FA4's `_flash_attn_fwd` and `_flash_attn_bwd` check and key their arguments in Python before the
compiled kernels they end with. On an H200 host (S 2K-8K, d 128, medians of calls interleaved with
their replays) a forward call took 186-272 us of host time and its replay 58-148 us, a backward 173-216
and 126-195 us. Where calls are short that host time is the time: 16 packed documents of 2K (one call
each), `fa4`, forward 5.55 -> 4.23 ms, forward+backward 13.9 -> 12.9 ms.

How: the second call with a signature (every tensor's shape, strides, dtype, device, alignment and
`requires_grad`, which tensors share memory, the other arguments' values, grad mode; the first call may
compile, so it is not recorded) runs FA4's own function while recording
- each compiled kernel it calls through FA4's `compile_cache`s, with its arguments (any other use of a
  cache leaves no plan), and
- every torch operation it runs (a `TorchFunctionMode`).
Where no operation writes into a tensor (in place, `out=`, item assignment) or reads one's values to the
host, and every tensor that a kernel or the result gets is an input, an `empty*`/`zeros*` allocation, or
a view of one, the call becomes a plan: later calls allocate the same buffers (zeroed where FA4 zeroed
them), call the same kernels with their own tensors in place, and return the same structure. Anything
else keeps that signature on FA4's own path. The plans hold shapes and positions, no tensor.

Trusted only for the FA4 releases whose sources we read to launch every kernel through those caches
(`REPLAYED_RELEASES`): a kernel launched another way would leave its output unwritten in a replay.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

REPLAYED_RELEASES = ("4.0.0b36",)
_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty"}
_ZEROS = {"zeros", "zeros_like", "new_zeros"}
_MAX_PLANS = 256  # signatures kept per function; the cache starts over past this
# held by every call that runs FA4's own function: while one records, the interface's caches are spies that
# another thread's call must not log into
_OWN_PATH = threading.Lock()


_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                     "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
# operations that bring a tensor's values to the host, where Python could branch on them or pass them on
_HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__complex__",
               "__array__", "__repr__", "__str__", "__format__"}


def _refused(name: str, args: tuple, kwargs: dict, out) -> bool:
    """Whether a torch operation keeps a call from becoming a plan: it may write into an existing tensor (in
    place, `out=`), or it reads values to the host (a plan keys no tensor's values)."""
    if name in _IN_PLACE_DUNDERS or name in _HOST_READS or "out" in kwargs:
        return True
    if name.endswith("_") and not name.endswith("__"):
        return True
    # a copy to another device (`to("cpu")`, say)
    return isinstance(out, torch.Tensor) and any(isinstance(a, torch.Tensor) and a.device != out.device for a in args)


class _Recorder(TorchFunctionMode):
    """Every torch operation run inside: the allocations (kept alive, so no memory is reused while
    recording) and the first operation that keeps the call from becoming a plan (`_refused`)."""

    def __init__(self):
        super().__init__()
        self.allocs: list[tuple[torch.Tensor, bool]] = []  # (tensor, zeroed)
        self.refused: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "").split(".")[0]  # (`zero_.default`: an aten overload)
        if isinstance(out, torch.Tensor) and (name in _EMPTY or name in _ZEROS):
            self.allocs.append((out, name in _ZEROS))
        elif self.refused is None and _refused(name, args, kwargs, out):
            self.refused = name
        return out


class _Spy:
    """A stand-in for a `compile_cache` while recording: hands out its compiled functions wrapped so that
    each call is logged (and run with torch functions undisturbed by the recorder). Any other use of the
    cache than `in`, `[key]`, `get` and storing (`used_otherwise`) keeps the call from becoming a plan: a
    kernel reached another way would not be logged."""

    def __init__(self, cache, log: list):
        self._cache, self._log = cache, log
        self.used_otherwise: str | None = None

    def _logged(self, fn):
        log = self._log

        def logged(*args, **kwargs):
            log.append((fn, args, kwargs))
            with torch._C.DisableTorchFunction():
                return fn(*args, **kwargs)

        return logged

    def __getitem__(self, key):
        return self._logged(self._cache[key])

    def get(self, key, default=None):
        return self._logged(self._cache[key]) if key in self._cache else default

    def __contains__(self, key) -> bool:
        return key in self._cache

    def __setitem__(self, key, value) -> None:
        self._cache[key] = value

    def __getattr__(self, name):
        self.used_otherwise = self.used_otherwise or name
        return getattr(self._cache, name)


class _Unknown(Exception):
    """A tensor of no known origin, or an argument the plan cannot rebuild."""


@dataclass(frozen=True)
class _Alloc:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    zeroed: bool


@dataclass
class _Plan:
    allocs: list[_Alloc]  # the allocations the kernels or the result use, in order
    calls: list[tuple[Callable, Callable, Callable]]  # (compiled function, args builder, kwargs builder)
    result: Callable  # builder


# A template is a tree: ("t", source, index, size, stride, offset, whole) for a tensor, a view of input
# `index` (source "in") or of allocation `index` (source "new") at storage offset `offset` from its base
# (`whole`: the base itself);
# ("seq", type, items) for tuples, lists and named tuples; ("dict", keys, items); ("const", value) for
# anything immutable.
_CONSTS = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _template(x, bases: list[tuple[str, int, torch.Tensor]], used: dict[int, int]):
    """`x`'s template over `bases` (the inputs, then the recorded allocations); `used` numbers the
    allocations in the order the templates first take them (a plan makes only those)."""
    if isinstance(x, torch.Tensor):
        ptr = x.untyped_storage().data_ptr()
        same = [b for b in bases if b[2].untyped_storage().data_ptr() == ptr]
        exact = [b for b in same if b[2].data_ptr() == x.data_ptr()]
        if not (exact or same):
            raise _Unknown
        src, i, base = (exact or same)[0]
        if src == "new":
            i = used.setdefault(i, len(used))
        offset = x.storage_offset() - base.storage_offset()
        whole = offset == 0 and x.shape == base.shape and x.stride() == base.stride()
        return ("t", src, i, tuple(x.shape), tuple(x.stride()), offset, whole)
    if isinstance(x, (tuple, list)):
        return ("seq", type(x), [_template(y, bases, used) for y in x])
    if isinstance(x, dict):
        return ("dict", list(x), [_template(y, bases, used) for y in x.values()])
    if isinstance(x, _CONSTS):
        return ("const", x)
    raise _Unknown


def _builder(t) -> tuple[bool, Any]:
    """`(True, value)` for a template that holds no tensor, else `(False, fn)` with `fn(inputs, new)`
    building it from a call's inputs and allocations; made once per plan, so that a replay only fills in
    its tensors."""
    kind = t[0]
    if kind == "const":
        return True, t[1]
    if kind == "t":
        _, src, i, size, stride, offset, whole = t
        if src == "in":  # (FA4 passes its inputs detached, as DLPack exports only those)
            if whole:
                return False, lambda inputs, new: inputs[i].detach()
            return False, lambda inputs, new: _view(inputs[i].detach(), size, stride, offset)
        if whole:
            return False, lambda inputs, new: new[i]
        return False, lambda inputs, new: _view(new[i], size, stride, offset)
    parts = [_builder(y) for y in t[2]]
    if kind == "dict":
        keys = t[1]
        make = lambda values: dict(zip(keys, values))
    else:
        cls = t[1]
        make = cls._make if hasattr(cls, "_make") else cls
    if all(const for const, _ in parts):
        return True, make([v for _, v in parts])
    fns = [(lambda inputs, new, v=v: v) if const else v for const, v in parts]
    return False, lambda inputs, new: make([f(inputs, new) for f in fns])


def _built(t) -> Callable:
    """A template's builder, constants too: `fn(inputs, new)`."""
    const, v = _builder(t)
    return (lambda inputs, new: v) if const else v


def _view(base: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    return base.as_strided(size, stride, base.storage_offset() + offset)


def _tensor_sig(t: torch.Tensor, first: dict[int, tuple[int, int]], i: int) -> tuple:
    # which earlier input shares this one's memory, and where: k and v packed in one buffer, say
    shared = first.setdefault(t.untyped_storage().data_ptr(), (i, t.data_ptr()))
    # (alignment mod 32 bytes: FA4 assumes at most 32 of any tensor)
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 32, t.requires_grad, shared[0],
            t.data_ptr() - shared[1])


class Replayed:
    """`fn(*args, **kwargs)` (an FA4 interface function), replayed from a plan where its signature has
    one (see the module's docstring). `caches` are FA4's functions that hold `compile_cache`s."""

    def __init__(self, fn: Callable, caches: list):
        self.fn, self.caches = fn, caches
        self.plans: dict[tuple, _Plan | int | None] = {}  # signature -> plan, calls seen, or None: FA4's path

    def __call__(self, *args, **kwargs):
        inputs: list[torch.Tensor] = []
        first: dict[int, tuple[int, int]] = {}
        sig: list = [torch.is_grad_enabled()]
        for key, a in [*enumerate(args), *kwargs.items()]:
            if isinstance(a, torch.Tensor):
                sig.append((key, _tensor_sig(a, first, len(inputs))))
                inputs.append(a)
            elif isinstance(a, _CONSTS):
                sig.append((key, type(a), a))
            else:
                with _OWN_PATH:
                    return self.fn(*args, **kwargs)
        sig = tuple(sig)
        plan = self.plans.get(sig, 0)
        if isinstance(plan, _Plan):
            return self._replay(plan, inputs)
        with _OWN_PATH:
            if plan is None:
                return self.fn(*args, **kwargs)
            if plan == 0:  # the first call may compile: not recorded
                self._keep(sig, 1)
                return self.fn(*args, **kwargs)
            result, plan = self._record(args, kwargs, inputs)
            self._keep(sig, plan)
            return result

    def _keep(self, sig: tuple, value) -> None:
        if len(self.plans) >= _MAX_PLANS:
            self.plans.clear()
        self.plans[sig] = value

    def _record(self, args, kwargs, inputs: list[torch.Tensor]):
        """FA4's own call, recorded: `(result, plan or None)`. A call that raises while recorded runs again
        unrecorded, so that the recorder and the spies never change what FA4 does (its own error, if it
        has one, is the one raised)."""
        log: list = []
        saved = [(f, f.compile_cache) for f in self.caches]
        spies = [_Spy(cache, log) for _, cache in saved]
        recorder = _Recorder()
        failed = False
        try:
            for (f, _), spy in zip(saved, spies):
                f.compile_cache = spy
            with recorder:
                result = self.fn(*args, **kwargs)
        except Exception:
            failed = True
        finally:
            for f, cache in saved:
                f.compile_cache = cache
        if failed:
            return self.fn(*args, **kwargs), None
        if recorder.refused is not None or not log or any(spy.used_otherwise for spy in spies):
            return result, None
        bases = [("in", i, t) for i, t in enumerate(inputs)]
        bases += [("new", i, t) for i, (t, _) in enumerate(recorder.allocs)]
        used: dict[int, int] = {}  # recorded allocation -> its place among those the plan makes
        try:
            calls = [(fn, _built(_template(list(a), bases, used)), _built(_template(kw, bases, used)))
                     for fn, a, kw in log]
            tree = _built(_template(result, bases, used))
        except _Unknown:
            return result, None
        allocs = [None] * len(used)
        for i, j in used.items():
            t, zeroed = recorder.allocs[i]
            allocs[j] = _Alloc(tuple(t.shape), t.stride(), t.dtype, t.device, zeroed)
        return result, _Plan(allocs, calls, tree)

    def _replay(self, plan: _Plan, inputs: list[torch.Tensor]):
        new = []
        for a in plan.allocs:
            t = torch.empty_strided(a.size, a.stride, dtype=a.dtype, device=a.device)
            new.append(t.zero_() if a.zeroed else t)
        for fn, args, kwargs in plan.calls:
            fn(*args(inputs, new), **kwargs(inputs, new))
        return plan.result(inputs, new)
