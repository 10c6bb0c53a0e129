"""The kernels' launch path (`kernels/launch.py`: Triton's launch without its binder, taken by the LSE
toolkit and by the Hopper attention kernels), tested on fakes here and on the GPU in
tests/test_lse_toolkit_gpu.py and tests/test_attention_hopper_gpu.py. Judged as tests/test_lse_toolkit.py
says."""

from __future__ import annotations

import pytest
import torch

from lse_checks import INTERPRETER_WARNINGS, judge_against, kernel_forward, make_x

pytestmark = INTERPRETER_WARNINGS

# ----------------------------------------------------------------------------------------------------
# the fast path needs CUDA: its logic is tested here on fakes, its kernels in tests/test_lse_toolkit_gpu.py


def test_launch_spec_features():
    """`_spec` is at least as fine as Triton 3.6's specialisation: every class Triton compiles apart
    gets its own features, and values Triton treats alike may share them."""
    from ringlse.kernels.launch import _spec

    buf = torch.empty(64)
    aligned, offset = buf[:8], buf[1:9]
    assert aligned.data_ptr() % 16 == 0 and offset.data_ptr() % 16 != 0
    assert _spec(aligned) != _spec(offset)  # pointer alignment (Triton's "D" on pointers)
    assert _spec(aligned) != _spec(aligned.half())  # dtype
    ints = [1, 16, 17, 2**31, 2**31 + 1, 2**63, -16]
    features = [_spec(v) for v in ints]
    assert len(set(features[:6])) == 6, features  # == 1, % 16, and int32 / int64 / uint64 range
    assert _spec(-16) == _spec(16) and _spec(32) == _spec(16) and _spec(3) == _spec(17)
    others = [_spec(True), _spec(1.0), _spec(None)]
    assert _spec(False) == _spec(True)  # Triton passes bools as i1, unspecialised
    assert len(set(others + features[:6] + [_spec(aligned)])) == 10
    assert _spec("x") is None and _spec((1, 2)) is None  # types left to Triton's own path


class _FakeParam:
    def __init__(self, name: str, is_constexpr: bool):
        self.name, self.is_constexpr = name, is_constexpr


class _FakeCompiled:
    def __init__(self, kernel, tag: int):
        self.kernel, self.function, self.packed_metadata = kernel, tag, ("meta", tag)

    @property
    def run(self):
        return lambda *a: self.kernel.calls.append(("fast", a))


class _FakeKernel:
    """What `launch` reads of a Triton 3.6 JITFunction: params, arg_names, pre_run_hooks, warmup, [grid]."""

    def __init__(self):
        self.params = [_FakeParam("x", False), _FakeParam("n", False), _FakeParam("B", True), _FakeParam("C", True)]
        self.arg_names = [p.name for p in self.params]
        self.pre_run_hooks = []
        self.compiled = []
        self.calls = []

    def warmup(self, *args, grid, num_warps, **consts):
        self.compiled.append((args, num_warps, consts))
        return _FakeCompiled(self, len(self.compiled))

    def __getitem__(self, grid):
        return lambda *a, **k: self.calls.append(("slow", grid, a, k))


def test_launch_cache_and_call_protocol(monkeypatch):
    """Hits call the compiled launcher as `JITFunction.run` does (grid padded to 3, stream, function,
    metadata, no hooks, every parameter in signature order, constexprs included); a key differing in
    any specialisation feature (integers: in value) compiles again; what the fast path does not handle
    goes to kernel[grid]."""
    from ringlse.kernels import launch as kl

    monkeypatch.setattr(kl, "_CACHE", {})
    monkeypatch.setattr(kl, "_fast_path_on", lambda kernel: True)
    monkeypatch.setattr(kl, "_STREAM_GETTER", lambda index: 1000 + index)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    k = _FakeKernel()
    kl.launch(k, (4,), 7, 32, num_warps=4, B=8, C=True)
    assert len(k.compiled) == 1 and k.compiled[0] == ((7, 32), 4, {"B": 8, "C": True})
    assert k.calls[-1] == ("fast", (4, 1, 1, 1002, 1, ("meta", 1), None, None, None, 7, 32, 8, True))
    kl.launch(k, (5, 6), 7, 32, num_warps=4, B=8, C=True)  # same arguments: a hit
    assert len(k.compiled) == 1
    assert k.calls[-1] == ("fast", (5, 6, 1, 1002, 1, ("meta", 1), None, None, None, 7, 32, 8, True))
    # integers are keyed by value (finer than Triton's features, whose cache then serves the compile):
    # another multiple of 16, not % 16, == 1, int64: each apart
    for n, tag in [(48, 2), (33, 3), (1, 4), (2**40, 5)]:
        kl.launch(k, (1, 1, 3), 9, n, num_warps=4, B=8, C=True)
        assert len(k.compiled) == tag and k.calls[-1][1][:6] == (1, 1, 3, 1002, tag, ("meta", tag))
    kl.launch(k, (1,), 9, 32, num_warps=8, B=8, C=True)  # num_warps
    kl.launch(k, (1,), 9, 32, num_warps=4, B=16, C=True)  # a constexpr's value
    kl.launch(k, (1,), 9, 32, num_warps=4, B=8, C=1)  # its type (1 == True)
    assert len(k.compiled) == 8 and all(c[0] == "fast" for c in k.calls)
    slow = [
        ((torch.zeros(3), 32), {"B": 8, "C": True}),  # a CPU tensor
        ((9, 32, 8), {"C": True}),  # a constexpr passed positionally
        ((9,), {"n": 32, "B": 8, "C": True}),  # a runtime argument by keyword
        ((9, "32"), {"B": 8, "C": True}),  # an unhandled type
        ((9, 32), {"B": [8], "C": True}),  # an unhashable constexpr
    ]
    for args, consts in slow:
        kl.launch(k, (2,), *args, num_warps=4, **consts)
        assert k.calls[-1] == ("slow", (2,), args, {"num_warps": 4, **consts})
    assert len(k.compiled) == 8


class _FakeLauncher:
    """What `BoundLaunch` reads of a Triton 3.6 CudaLauncher: its C function, flags and scratch sizes."""

    def __init__(self, kernel, scratch: int):
        self.kernel, self.global_scratch_size, self.profile_scratch_size = kernel, scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = True, False

    def launch(self, *a):
        self.kernel.calls.append(("c", a))

    def __call__(self, *a):
        self.kernel.calls.append(("run", a))


class _FakeBoundKernel(_FakeKernel):
    scratch = 0

    def warmup(self, *args, grid, num_warps, **consts):
        compiled = super().warmup(*args, grid=grid, num_warps=num_warps, **consts)
        launcher = _FakeLauncher(self, self.scratch)
        return type("Compiled", (), {"run": launcher, "function": compiled.function,
                                     "packed_metadata": compiled.packed_metadata})()


def test_bound_launch_call_protocol(monkeypatch):
    """A `BoundLaunch` call hands the compiled kernel's C launcher what Triton's Python wrapper would
    (grid padded to 3, stream, function, cooperative and PDL flags, no scratch, metadata, no hooks,
    every parameter in signature order with the free ones put in, constexprs last); the fixed
    arguments are taken once, a free argument of another specialisation compiles again, a kernel with
    scratch goes through the wrapper, and what the fast path does not handle goes to Triton's path."""
    from triton.knobs import HookChain

    from ringlse.kernels import launch as kl

    monkeypatch.setattr(kl, "_CACHE", {})
    monkeypatch.setattr(kl, "_JITFunction", _FakeBoundKernel)
    monkeypatch.setattr(kl, "_STREAM_GETTER", lambda index: 1000 + index)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    k = _FakeBoundKernel()
    with pytest.raises(TypeError, match="FREE"):  # a plan holds no tensor
        kl.BoundLaunch(k, (4,), torch.zeros(2), kl.FREE, num_warps=4, B=8, C=True)
    go = kl.BoundLaunch(k, (4,), 7, kl.FREE, num_warps=4, B=8, C=True)
    go(32)
    assert k.compiled == [((7, 32), 4, {"B": 8, "C": True})]
    assert k.calls[-1] == ("c", (4, 1, 1, 1002, 1, True, False, None, None, ("meta", 1), None, None, None, 7, 32, 8, True))
    go(48)  # the features of 32 (a multiple of 16): a hit
    assert len(k.compiled) == 1 and k.calls[-1][1][-3:] == (48, 8, True)
    # not % 16, == 1, int64: each compiled apart; then 64, a hit on 32's
    for n, compiled, tag in [(33, 2, 2), (1, 3, 3), (2**40, 4, 4), (64, 4, 1)]:
        go(n)
        assert len(k.compiled) == compiled and k.calls[-1][1][4] == tag and k.calls[-1][1][-3] == n
    kl.BoundLaunch(k, (5, 6), 7, kl.FREE, num_warps=4, B=8, C=True)(32)  # a 2-D grid, padded to 3
    assert k.calls[-1][0] == "c" and k.calls[-1][1][:3] == (5, 6, 1)
    cpu = torch.zeros(3)
    go(cpu)  # a CPU tensor: Triton's path, with the tensor itself
    assert k.calls[-1][:2] == ("slow", (4,)) and k.calls[-1][2][0] == 7 and k.calls[-1][2][1] is cpu
    hook = HookChain()
    hook.add(lambda metadata: None)
    monkeypatch.setattr(kl._knobs.runtime, "launch_enter_hook", hook)
    go(32)  # a launch hook set (a profiler): Triton's path
    assert k.calls[-1] == ("slow", (4,), (7, 32), {"num_warps": 4, "B": 8, "C": True})
    monkeypatch.undo()
    monkeypatch.setattr(kl, "_CACHE", {})
    monkeypatch.setattr(kl, "_JITFunction", _FakeBoundKernel)
    monkeypatch.setattr(kl, "_STREAM_GETTER", lambda index: 1000 + index)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    scratchy = _FakeBoundKernel()
    scratchy.scratch = 128
    kl.BoundLaunch(scratchy, (3,), kl.FREE, 5, num_warps=4, B=8, C=True)(16)  # scratch: Triton's wrapper
    assert scratchy.calls[-1] == ("run", (3, 1, 1, 1002, 1, ("meta", 1), None, None, None, 16, 5, 8, True))
    seen = []
    monkeypatch.setattr(kl, "launch", lambda kernel, grid, *a, **kw: seen.append((kernel, grid, a, kw)))
    plain = _FakeKernel()  # not a JITFunction (the interpreter's kernels are not): `launch` decides
    kl.BoundLaunch(plain, (3,), kl.FREE, 5, num_warps=4, B=8, C=True)(16)
    assert seen == [(plain, (3,), (16, 5), {"num_warps": 4, "B": 8, "C": True})] and not plain.calls


class _FakeCudaTensor:
    """What a `TmaDesc` reads of its tensor, for a CUDA tensor on a machine without one."""

    def __init__(self, ptr: int):
        self.ptr, self.dtype, self.is_cuda = ptr, torch.float16, True

    def data_ptr(self) -> int:
        return self.ptr


class _FakeTmaKernel(_FakeKernel):
    """A kernel of a descriptor, an integer and a constexpr, compiled as Triton 3.6 compiles one: its
    launcher's descriptor wrapper closes over the C function."""

    def __init__(self):
        super().__init__()
        self.params = [_FakeParam("desc", False), _FakeParam("n", False), _FakeParam("B", True)]
        self.arg_names = [p.name for p in self.params]

    def warmup(self, *args, grid, num_warps, **consts):
        compiled = super().warmup(*args, grid=grid, num_warps=num_warps, **consts)
        kernel = self

        def launch(*a):
            kernel.calls.append(("c", a))

        def wrapper(*a):  # Triton's: builds every tensor map again, per launch
            raise AssertionError("the fast path calls the C function itself")
            launch(*a)

        run = type("Run", (), dict(launch=staticmethod(wrapper), global_scratch_size=0, profile_scratch_size=0,
                                   launch_cooperative_grid=False, launch_pdl=True))()
        meta = type("Meta", (), {"tensordesc_meta": [dict(swizzle=64, elem_size=2, elem_type=1, block_size=[16, 32],
                                                          fp4_padded=False)]})()
        return type("Compiled", (), {"run": run, "function": compiled.function, "metadata": meta,
                                     "packed_metadata": compiled.packed_metadata})()


def test_launch_tma_descriptors(monkeypatch):
    """A kernel taking TMA descriptors (`TmaDesc`): a hit hands the C launcher each descriptor's tensor
    map, shape and strides (as Triton's wrapper would), the map built once per content (address, shape,
    strides), not per launch; a descriptor of another alignment compiles apart, where Triton's own checks
    run (a misaligned base raises); with the fast path off Triton gets a real `TensorDescriptor`."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ringlse.kernels import launch as kl

    monkeypatch.setattr(kl, "_CACHE", {})
    monkeypatch.setattr(kl, "_TENSOR_MAPS", {})
    monkeypatch.setattr(kl, "_fast_path_on", lambda kernel: True)
    monkeypatch.setattr(kl, "_STREAM_GETTER", lambda index: 1000 + index)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    maps = []
    monkeypatch.setattr(kl, "_make_tensordesc_arg",
                        lambda d, meta: maps.append(d.base.data_ptr()) or [("map", len(maps)), *d.shape, *d.strides])
    layout = gl.NVMMASharedLayout.get_default_for([16, 32], gl.float16)
    desc = lambda ptr, rows=64: kl.TmaDesc(_FakeCudaTensor(ptr), (rows, 32), (32, 1), (16, 32), layout)  # noqa: E731
    k = _FakeTmaKernel()
    kl.launch(k, (4,), desc(4096), 7, num_warps=4, B=8)
    assert len(k.compiled) == 1 and isinstance(k.compiled[0][0][0], TensorDescriptor)  # compiled for a real one
    call = ("c", (4, 1, 1, 1002, 1, False, True, None, None, ("meta", 1), None, None, None,
                  ("map", 1), 64, 32, 32, 1, 7, 8))
    assert k.calls == [call] and maps == [4096]
    kl.launch(k, (4,), desc(4096), 7, num_warps=4, B=8)  # a hit, and the same tensor map
    assert len(k.compiled) == 1 and k.calls[-1] == call and maps == [4096]
    kl.launch(k, (4,), desc(8192, rows=80), 7, num_warps=4, B=8)  # same features, new content: a new map
    assert len(k.compiled) == 1 and maps == [4096, 8192] and k.calls[-1][1][13:16] == (("map", 2), 80, 32)
    with pytest.raises(AssertionError, match="16-byte aligned"):  # another key: Triton's checks see it
        kl.launch(k, (4,), desc(4104), 7, num_warps=4, B=8)
    monkeypatch.setattr(kl, "_fast_path_on", lambda kernel: False)
    kl.launch(k, (3,), desc(4096), 7, num_warps=4, B=8)
    assert k.calls[-1][:2] == ("slow", (3,)) and isinstance(k.calls[-1][2][0], TensorDescriptor)
    with pytest.raises(TypeError, match="TMA"):
        kl.BoundLaunch(k, (4,), desc(4096), kl.FREE, num_warps=4, B=8)


def test_fast_path_only_on_the_triton_it_knows(monkeypatch):
    """The fast paths call Triton 3.6's launcher internals, so they are on for 3.6 only (`FAST_PATH`);
    with them off (another Triton, forced here) a `BoundLaunch` is Triton's own `kernel[grid](...)`,
    through the same interface and with the same arguments."""
    from ringlse.kernels import launch as kl

    assert kl.fast_path_supported("3.6.0") and kl.fast_path_supported("3.6.1+git1a2b3c")
    assert not any(map(kl.fast_path_supported, ("3.5.1", "3.7.0", "4.6.0", "36.0", "dev")))
    import triton

    assert kl.FAST_PATH == kl.fast_path_supported(triton.__version__)
    monkeypatch.setattr(kl, "_CACHE", {})
    monkeypatch.setattr(kl, "_JITFunction", _FakeBoundKernel)
    monkeypatch.setattr(kl, "_STREAM_GETTER", lambda index: 1000 + index)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    k = _FakeBoundKernel()
    go = kl.BoundLaunch(k, (4,), 7, kl.FREE, num_warps=4, B=8, C=True)
    go(32)
    assert k.calls[-1][0] == "c"  # (the fast path, where it is on)
    monkeypatch.setattr(kl, "FAST_PATH", False)
    go(32)
    kl.launch(k, (2,), 9, 16, num_warps=4, B=8, C=True)
    assert k.calls[-2:] == [("slow", (4,), (7, 32), {"num_warps": 4, "B": 8, "C": True}),
                            ("slow", (2,), (9, 16), {"num_warps": 4, "B": 8, "C": True})]


def test_launch_takes_tritons_path_when_it_must(kernels, monkeypatch):
    from triton.knobs import HookChain

    from ringlse.kernels import launch as kl

    from ringlse.lse.kernels.softmax.row_kernels import fwd_rows_kernel

    assert not kl._fast_path_on(fwd_rows_kernel)  # the interpreter (these CPU tests)
    assert kl._hook_idle(None) and kl._hook_idle(HookChain())
    hook = HookChain()
    hook.add(lambda metadata: None)
    assert not kl._hook_idle(hook) and not kl._hook_idle(lambda metadata: None)
    # under the interpreter `launch` is kernel[grid]: a short softmax through it
    x = make_x((5, 97), -1, torch.float32, seed=21)
    judge_against("fwd", kernel_forward(kernels, "softmax", x, -1), x, -1, "softmax", torch.float32)
