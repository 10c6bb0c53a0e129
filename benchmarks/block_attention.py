"""Block-attention kernels on one GPU: our Triton forward/backward next to SDPA flash (FA2) and cuDNN.

Usage (on a GPU):
    python benchmarks/block_attention.py [--quick] [--out DIR]      # table + results JSON
    python benchmarks/block_attention.py --sweep                     # time candidate tile configs
    python benchmarks/block_attention.py --precompile N [--sweep]    # compile in N processes first
    python benchmarks/block_attention.py --coverage-only [--softcap 30]  # softcap on/off, sinks on/off, d 192/128 vs FA4
Without a GPU:
    python benchmarks/block_attention.py --aot [--sweep]   # compile for sm_90 here; ptxas registers/spills

FLOPs per CONVENTIONS.md §8: 4·B·H·Sq·Sk·D forward, halved for causal; backward 2.5x forward. Times are
`triton.testing.do_bench` medians; inputs rotate among several sets when one set fits in L2.
Our backward time is delta + dk/dv + dq kernels, adding into float32 accumulators (the block-op
contract); the peers' backward is the autograd backward of `scaled_dot_product_attention`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import torch

# CONVENTIONS.md §9: peer figures measured on one H200, bf16, d=128, 32 heads, S=32K (non-causal, causal)
PEER_FIGURES_H200 = {
    "sdpa_flash_fwd": (353, 337),
    "sdpa_flash_bwd": (318, 321),
    "cudnn_fwd": (597, 601),
    "cudnn_bwd": (535, 525),
}

# (batch, heads, seqlen, head_dim, kv_heads)
FULL_SHAPES = [
    (b, h, s, d, h)
    for d in (128, 64)
    for (b, h, s) in ((2, 16, 4096), (2, 16, 8192), (1, 32, 16384), (1, 32, 32768))
] + [(1, 32, 16384, 128, 8), (1, 32, 16384, 64, 8)]  # GQA 32/8: speed per FLOP with shared K/V heads
QUICK_SHAPES = [(2, 16, 8192, 128, 16), (1, 32, 16384, 128, 16), (2, 16, 8192, 64, 16), (1, 32, 16384, 128, 8)]
SWEEP_SHAPES = [(2, 16, 8192, 128), (2, 16, 8192, 64)]


def fwd_sweep_configs(d: int):
    """Forward candidates; 4-warp 128-row tiles that spill (ptxas report of --aot) are left out."""
    from ringlse.kernels.attention_fwd import FwdConfig as C

    if d <= 64:
        return [C(128, 64, 4, 3), C(128, 128, 8, 3), C(128, 64, 8, 4), C(64, 64, 4, 4), C(128, 128, 8, 4)]
    return [C(128, 64, 8, 3), C(128, 64, 8, 4), C(128, 128, 8, 2), C(128, 32, 4, 4), C(64, 64, 4, 3)]


def bwd_sweep_configs(d: int):
    """(kv_block_n, kv_block_m, warps, stages) for dk/dv and (q_block_m, q_block_n, warps, stages) for
    dq are swept separately (each kernel timed alone), zipped into BwdConfigs for compactness."""
    from ringlse.kernels.attention_bwd import BwdConfig as C

    if d <= 64:
        kv = [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 3)]
        q = [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 2)]
    else:
        kv = [(128, 64, 8, 2), (128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 8, 2)]
        q = [(128, 64, 8, 2), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 2)]
    return [C(*a, *b) for a, b in zip(kv, q)]


def attn_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * sq * sk * d
    return f / 2 if causal else f


# ---------------------------------------------------------------------------------------------------
# ahead-of-time compile (no GPU): how many registers, spills and how much shared memory each config


def _install_fake_driver(arch: int = 90):
    """Make Triton compile for `sm_<arch>` without a GPU: launches only compile (warmup)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    class _FakeDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    triton.runtime.driver.set_active(_FakeDriver())
    compiled: list = []

    def getitem(self, grid):
        def go(*args, **kwargs):
            t0 = time.time()
            k = self.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append((self.fn.__name__, k, time.time() - t0))

        return go

    JITFunction.__getitem__ = getitem
    return compiled


def _ptxas_report(kernel) -> str:
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run(
            [triton.knobs.nvidia.ptxas.path, "-v", "-arch=sm_90a", path, "-o", os.path.join(tmp, "k.o")],
            capture_output=True, text=True,
        )
    regs = spill = "?"
    for line in r.stderr.splitlines():
        if "Used" in line and "registers" in line:
            regs = line.split("Used")[1].split("registers")[0].strip()
        if "spill stores" in line:
            spill = line.split("bytes spill stores")[0].split(",")[-1].strip()
    return f"regs {regs:>4} spill {spill:>4}B"


def _compile_calls(shapes, sweep: bool, device: str):
    """Every kernel launch the benchmark (or sweep) makes, as thunks over empty tensors on `device`."""
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_fwd as F

    calls = []
    for (b, h, s, d, *_) in shapes:
        q = torch.empty(b, s, h, d, dtype=torch.bfloat16, device=device)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=device)
        acc = torch.empty(b, s, h, d, dtype=torch.float32, device=device)
        for causal in (False, True):
            fcfgs = fwd_sweep_configs(d) if sweep else [F.fwd_configs(d, q.dtype, causal)[0]]
            bcfgs = bwd_sweep_configs(d) if sweep else [B.bwd_configs(d, q.dtype, causal)[0]]
            for cfg in fcfgs:
                calls.append((f"fwd {s} d{d} causal={causal:d} {cfg}", lambda q=q, lse=lse, cfg=cfg, c=causal: F._forward_impl(
                    q, q, q, q, lse, softmax_scale=0.1, causal=c, offset=0, accum=False, config=cfg)))
            for cfg in fcfgs:
                calls.append((f"fwd+merge {s} d{d} causal={causal:d} {cfg}", lambda q=q, lse=lse, acc=acc, cfg=cfg, c=causal: F._forward_impl(
                    q, q, q, acc, lse, softmax_scale=0.1, causal=c, offset=0, accum=True, config=cfg)))
            for cfg in bcfgs:
                calls.append((f"bwd {s} d{d} causal={causal:d} {cfg}", lambda q=q, lse=lse, acc=acc, cfg=cfg, c=causal: B._backward_impl(
                    q, q, q, q, lse, lse, acc, acc, acc, qk_scale=0.1, dq_scale=0.1, dk_scale=0.1, causal=c, offset=0,
                    config=cfg)))
        calls.append((f"delta {s} d{d}", lambda q=q: B.attention_delta(q, q)))
    return calls


def _coverage_compile_calls(device: str):
    """The model-coverage kernels (softcap 30, d_qk 192 / d_v 128): the portable forward and backward at their first
    configs, and the Hopper forward and dk/dv kernels (`--aot --coverage`)."""
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_fwd as F

    calls = []
    s, h = 8192, 32
    for d, dv, cap in ((128, 128, 30.0), (192, 128, 0.0), (192, 128, 30.0)):
        q = torch.empty(1, s, h, d, dtype=torch.bfloat16, device=device)
        v = torch.empty(1, s, h, dv, dtype=torch.bfloat16, device=device)
        lse = torch.empty(1, h, s, dtype=torch.float32, device=device)
        acc = torch.empty(1, s, h, dv, dtype=torch.float32, device=device)
        dq = torch.empty(1, s, h, d, dtype=torch.float32, device=device)
        for causal in (False, True):
            tag = f"{s} d{d}/{dv} softcap={cap:g} causal={causal:d}"
            fcfg = F.fwd_configs(max(d, dv), q.dtype, causal)[0]
            bcfg = B.bwd_configs(max(d, dv), q.dtype, causal)[0]
            calls.append((f"fwd {tag} {fcfg}", lambda q=q, v=v, o=acc.to(q.dtype), lse=lse, cfg=fcfg, c=causal, cap=cap:
                          F._forward_impl(q, q, v, o, lse, softmax_scale=0.1, causal=c, offset=0, accum=False,
                                          config=cfg, softcap=cap)))
            calls.append((f"bwd {tag} {bcfg}", lambda q=q, v=v, lse=lse, acc=acc, dq=dq, cfg=bcfg, c=causal, cap=cap:
                          B._backward_impl(v, q, q, v, lse, lse, dq, dq, acc, qk_scale=0.1, dq_scale=0.1, dk_scale=0.1,
                                           causal=c, offset=0, config=cfg, softcap=cap)))
            if F.hopper_forward is not None:
                from ringlse.kernels import attention_bwd_hopper as BH
                from ringlse.kernels import attention_fwd_hopper as FH

                FH.sm_count = lambda index: 132  # (no GPU to ask: an H100's)
                for accum in (False, True):
                    calls.append((f"hopper fwd {tag} accum={accum:d}",
                                  lambda q=q, v=v, lse=lse, o=acc if accum else acc.to(q.dtype), c=causal, cap=cap,
                                  a=accum: FH.hopper_forward(q, q, v, o, lse, softmax_scale=0.1, causal=c, offset=0,
                                                             accum=a, softcap=cap)))
                if d == dv:
                    calls.append((f"hopper dkdv+dq {tag}",
                                  lambda q=q, lse=lse, dq=dq, c=causal, cap=cap: BH.hopper_dkdv(
                                      q, q, q, q, lse, lse, dq, dq.clone(), qk_scale=0.1, dk_scale=0.1, causal=c,
                                      offset=0, dq_acc=dq.clone(), dq_scale=0.1, softcap=cap)))
    return calls


def run_aot(args) -> None:
    compiled = _install_fake_driver()
    if args.coverage_only:
        calls = _coverage_compile_calls("cpu")
    else:
        shapes = SWEEP_SHAPES if args.sweep else (QUICK_SHAPES if args.quick else FULL_SHAPES)
        calls = _compile_calls(shapes, args.sweep, "cpu") + (_coverage_compile_calls("cpu") if args.coverage else [])
    seen = set()
    for name, thunk in calls:
        n0 = len(compiled)
        try:
            thunk()
        except Exception as err:  # report and go on: the point is to see which configs compile
            print(f"{name}: FAILED {type(err).__name__}: {str(err)[:200]}")
            continue
        for kname, k, dt in compiled[n0:]:
            key = (kname, k.hash) if hasattr(k, "hash") else (kname, id(k))
            if key in seen:
                continue
            seen.add(key)
            print(f"{name:<90} {kname:<24} smem {k.metadata.shared // 1024:>4}KB {_ptxas_report(k)}  {dt:.1f}s", flush=True)


def _precompile_worker(rank: int, nproc: int, shapes, sweep: bool) -> None:
    # compile (no launches) into Triton's on-disk cache, which the timing process then hits
    _install_fake_driver(90)
    for i, (name, thunk) in enumerate(_compile_calls(shapes, sweep, "cpu")):
        if i % nproc == rank:
            try:
                thunk()
            except Exception as err:
                print(f"precompile {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)


def precompile(nproc: int, shapes, sweep: bool) -> None:
    """Compile every kernel variant in `nproc` processes before timing (the GPU box has 16 cores)."""
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        print(f"precompile: skipped (device is sm_{major}{minor}, the precompiler targets sm_90)")
        return
    import multiprocessing as mp

    t0 = time.time()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_precompile_worker, args=(r, nproc, shapes, sweep)) for r in range(nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print(f"precompile: {nproc} processes, {time.time() - t0:.1f}s", flush=True)


# ---------------------------------------------------------------------------------------------------
# timing


def save_result(out_dir: str, stem: str, result: dict) -> str:
    """Write `result` as `out_dir/<stem>-<gpu>.json`; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    tag = torch.cuda.get_device_name(0).replace(" ", "_").replace("/", "_")
    path = os.path.join(out_dir, f"{stem}-{tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def _bench(fn, n_sets: int) -> float:
    import triton

    it = [0]

    def step():
        fn(it[0] % n_sets)
        it[0] += 1

    return triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")


def _make_sets(b, h, s, d, dtype, n_sets, device="cuda", hkv=None):
    sets = []
    hkv = h if hkv is None else hkv
    for _ in range(n_sets):
        q, do = (torch.randn(b, s, h, d, dtype=dtype, device=device) for _ in range(2))
        k, v = (torch.randn(b, s, hkv, d, dtype=dtype, device=device) for _ in range(2))
        sets.append((q, k, v, do))
    return sets


def _n_sets(b, h, s, d, dtype) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    one = 4 * b * s * h * d * torch.empty((), dtype=dtype).element_size()
    return 1 if one > 2 * l2 else 3


def time_ours(b, h, s, d, causal, dtype=torch.bfloat16, fwd_cfg=None, bwd_cfg=None, which=("fwd", "bwd"),
              hkv=None):
    """Median ms of our forward and backward (delta + dk/dv + dq)."""
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_fwd as F

    n = _n_sets(b, h, s, d, dtype)
    sets = _make_sets(b, h, s, d, dtype, n, hkv=hkv)
    scale = d**-0.5
    res = {}
    outs = [F.attention_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=0, k_start=0) for q, k, v, _ in sets]

    def fwd(i):
        F.attention_forward(sets[i][0], sets[i][1], sets[i][2], softmax_scale=scale, causal=causal, q_start=0,
                            k_start=0)

    if "fwd" in which:
        if fwd_cfg is None:
            res["fwd"] = _bench(fwd, n)
        else:
            o = torch.empty_like(sets[0][0])
            lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
            res["fwd"] = _bench(lambda i: F._forward_impl(
                sets[i][0], sets[i][1], sets[i][2], o, lse, softmax_scale=scale, causal=causal, offset=0,
                accum=False, config=fwd_cfg), n)
    if "merge" in which:
        acc = torch.zeros(b, s, h, d, dtype=torch.float32, device="cuda")
        lacc = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device="cuda")

        def merge(i):
            F.attention_forward(sets[i][0], sets[i][1], sets[i][2], softmax_scale=scale, causal=causal, q_start=0,
                                k_start=0, out_acc=acc, lse_acc=lacc)

        # the merge's cost is a few percent, near the drift of clocks between two timings taken one after
        # the other: the plain and merging forwards' launches interleaved (timing.py)
        from timing import interleaved_ms

        ms = interleaved_ms({"fwd": lambda r: fwd(r % n), "merge": lambda r: merge(r % n)})
        res["fwd_merge"] = ms["merge"]
        res["fwd_merge_ratio"] = ms["merge"] / ms["fwd"]
    if "bwd" in which or "dkdv" in which or "dq" in which:
        dq = torch.zeros(b, s, h, d, dtype=torch.float32, device="cuda")
        dk = torch.zeros(sets[0][1].shape, dtype=torch.float32, device="cuda")
        dv = torch.zeros_like(dk)

        def bwd(i, only=None):
            q, k, v, do = sets[i]
            o, lse = outs[i]
            delta = B.attention_delta(do, o)
            if bwd_cfg is None:
                B.attention_backward(do, q, k, v, o, lse, delta, softmax_scale=scale, causal=causal, q_start=0,
                                     k_start=0, dq_acc=dq, dk_acc=dk, dv_acc=dv)
            else:
                B._backward_impl(do, q, k, v, lse, delta, dq, dk, dv, qk_scale=scale * F.LOG2E, dq_scale=scale,
                                 dk_scale=scale, causal=causal, offset=0, config=bwd_cfg)

        if "bwd" in which:
            res["bwd"] = _bench(bwd, n)
    return res


def time_kernel_split(b, h, s, d, causal, bwd_cfg, dtype=torch.bfloat16):
    """dk/dv and dq kernel times alone for one BwdConfig (so the two halves are tuned separately)."""
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_fwd as F

    q, k, v, do = _make_sets(b, h, s, d, dtype, 1)[0]
    scale = d**-0.5
    o, lse = F.attention_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=0, k_start=0)
    delta = B.attention_delta(do, o)
    dq = torch.zeros(b, s, h, d, dtype=torch.float32, device="cuda")
    dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
    import triton

    grid_kv = (triton.cdiv(s, bwd_cfg.kv_block_n), b * h)
    grid_q = (triton.cdiv(s, bwd_cfg.q_block_m), b * h)
    bd = F.block_d(d)
    common = dict(HEAD_D=d, BLOCK_D=bd, CAUSAL=causal, DOT_PREC=F.dot_precision(dtype), INTERVALS=False, softcap=0.0,
                  HEAD_DV=d, BLOCK_DV=bd, SOFTCAP=0)

    def dkdv():
        B._attn_bwd_dkdv_kernel[grid_kv](
            q, k, v, do, lse, delta, dk, dv,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2), h, 1, s, s, 0, scale * F.LOG2E, scale, None, None,
            BLOCK_M=bwd_cfg.kv_block_m, BLOCK_N=bwd_cfg.kv_block_n, num_warps=bwd_cfg.kv_warps,
            num_stages=bwd_cfg.kv_stages, **common)

    def dqk():
        B._attn_bwd_dq_kernel[grid_q](
            q, k, v, do, lse, delta, dq,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
            h, 1, s, s, 0, scale * F.LOG2E, scale, None, None,
            BLOCK_M=bwd_cfg.q_block_m, BLOCK_N=bwd_cfg.q_block_n, num_warps=bwd_cfg.q_warps,
            num_stages=bwd_cfg.q_stages, **common)

    out = {}
    for name, fn in (("dkdv", dkdv), ("dq", dqk)):
        try:
            out[name] = triton.testing.do_bench(fn, warmup=30, rep=150, return_mode="median")
        except Exception as err:  # a config that does not fit: report, keep sweeping
            out[name] = float("nan")
            print(f"  {name} {bwd_cfg}: {type(err).__name__}: {str(err)[:120]}")
    return out


def time_sdpa(b, h, s, d, causal, backend, dtype=torch.bfloat16, hkv=None):
    """Median ms of SDPA forward and backward with one backend (inputs in our [b, s, h, d] layout,
    passed as transposed views, which both FA2 and cuDNN take without copies; GQA as `enable_gqa`)."""
    import torch.nn.functional as Fn
    from torch.nn.attention import sdpa_kernel

    n = _n_sets(b, h, s, d, dtype)
    sets = [tuple(t.transpose(1, 2).requires_grad_() for t in ts[:3]) + (ts[3].transpose(1, 2),)
            for ts in _make_sets(b, h, s, d, dtype, n, hkv=hkv)]
    gqa = {"enable_gqa": True} if hkv not in (None, h) else {}
    res = {}
    with sdpa_kernel(backend):
        res["fwd"] = _bench(lambda i: Fn.scaled_dot_product_attention(*sets[i][:3], is_causal=causal, **gqa), n)
        outs = [Fn.scaled_dot_product_attention(*st[:3], is_causal=causal, **gqa) for st in sets]

        def bwd(i):
            torch.autograd.grad(outs[i], sets[i][:3], sets[i][3], retain_graph=True)

        res["bwd"] = _bench(bwd, n)
    return res


def time_fa4(b, h, s, d, causal, dtype=torch.bfloat16, hkv=None):
    """Median ms of bare FlashAttention-4 (`flash_attn.cute.flash_attn_func`, our [b, s, h, d] layout)
    forward and backward, or None when it is not installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    n = _n_sets(b, h, s, d, dtype)
    sets = [tuple(t.requires_grad_() for t in ts[:3]) + (ts[3],) for ts in _make_sets(b, h, s, d, dtype, n, hkv=hkv)]

    def fwd(i):
        out = flash_attn_func(*sets[i][:3], causal=causal)
        return out[0] if isinstance(out, tuple) else out

    res = {"fwd": _bench(fwd, n)}
    outs = [fwd(i) for i in range(n)]
    res["bwd"] = _bench(lambda i: torch.autograd.grad(outs[i], sets[i][:3], sets[i][3], retain_graph=True), n)
    return res


def run_sweep(args) -> None:
    from torch.nn.attention import SDPBackend

    rows = []
    for (b, h, s, d) in SWEEP_SHAPES:
        for causal in (False, True):
            fl = attn_flops(b, h, s, s, d, causal)
            peers = time_sdpa(b, h, s, d, causal, SDPBackend.FLASH_ATTENTION)
            print(f"\n== b{b} h{h} s{s} d{d} causal={causal}: FA2 fwd {fl / peers['fwd'] / 1e9:.0f} "
                  f"bwd {2.5 * fl / peers['bwd'] / 1e9:.0f} TFLOP/s", flush=True)
            for cfg in fwd_sweep_configs(d):
                try:
                    ms = time_ours(b, h, s, d, causal, fwd_cfg=cfg, which=("fwd",))["fwd"]
                except Exception as err:
                    print(f"  fwd {cfg}: {type(err).__name__}: {str(err)[:120]}")
                    continue
                rows.append(dict(kind="fwd", b=b, h=h, s=s, d=d, causal=causal, cfg=asdict(cfg), ms=ms,
                                 tflops=fl / ms / 1e9, fa2_ratio=peers["fwd"] / ms))
                print(f"  fwd  {cfg}: {ms:.3f} ms {fl / ms / 1e9:.0f} TFLOP/s ({peers['fwd'] / ms:.2f}x FA2)", flush=True)
            for cfg in bwd_sweep_configs(d):
                t = time_kernel_split(b, h, s, d, causal, cfg)
                rows.append(dict(kind="bwd_split", b=b, h=h, s=s, d=d, causal=causal, cfg=asdict(cfg), **t))
                print(f"  dkdv {cfg.kv_block_n, cfg.kv_block_m, cfg.kv_warps, cfg.kv_stages}: {t['dkdv']:.3f} ms"
                      f"   dq {cfg.q_block_m, cfg.q_block_n, cfg.q_warps, cfg.q_stages}: {t['dq']:.3f} ms"
                      f"   (sum-if-paired {2.5 * fl / (t['dkdv'] + t['dq']) / 1e9:.0f} TFLOP/s)", flush=True)
    apply_sweep_winners(rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "block_attention-sweep.json"), "w") as f:
            json.dump(dict(rows=rows, command=" ".join(sys.argv), gpu=torch.cuda.get_device_name(0)), f, indent=1)


def apply_sweep_winners(rows) -> None:
    """Make the fastest forward, dk/dv and dq configs per (head dim, causal) the kernels' first choice."""
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_fwd as F

    keys = sorted({(r["d"], r["causal"]) for r in rows})
    print("\nsweep winners:")
    for d, causal in keys:
        fw = [r for r in rows if r["kind"] == "fwd" and (r["d"], r["causal"]) == (d, causal)]
        bw = [r for r in rows if r["kind"] == "bwd_split" and (r["d"], r["causal"]) == (d, causal)]
        if fw:
            best = min(fw, key=lambda r: r["ms"])
            F.set_tuned_fwd_config(d, torch.bfloat16, causal, F.FwdConfig(**best["cfg"]))
            print(f"  d{d} causal={causal:d} fwd {best['cfg']} {best['tflops']:.0f} TFLOP/s")
        ok = [r for r in bw if r["dkdv"] == r["dkdv"] and r["dq"] == r["dq"]]
        if ok:
            kv = min(ok, key=lambda r: r["dkdv"])["cfg"]
            q = min(ok, key=lambda r: r["dq"])["cfg"]
            cfg = B.BwdConfig(kv["kv_block_n"], kv["kv_block_m"], kv["kv_warps"], kv["kv_stages"],
                              q["q_block_m"], q["q_block_n"], q["q_warps"], q["q_stages"])
            B.set_tuned_bwd_config(d, torch.bfloat16, causal, cfg)
            print(f"  d{d} causal={causal:d} bwd {cfg}")


def _hopper_configs() -> dict:
    try:
        from ringlse.kernels.attention_fwd_hopper import CONFIGS
    except ImportError:
        return {}
    return CONFIGS


def _forward_kernel_name(d: int, hkv: int) -> str:
    """Which forward kernel `attention_forward` runs for bf16 inputs of this head dim on this GPU."""
    from ringlse.kernels import attention_fwd as F

    probe = torch.empty(1, 128, hkv, d, dtype=torch.bfloat16, device="cuda")
    ok = F.hopper_forward_applies is not None and F.hopper_forward_applies(probe, probe, probe)
    return "gluon-hopper" if ok else "triton"


# model coverage (softcap, V head dim of its own): (batch, heads, seqlen), bf16, causal and not
COVERAGE_SHAPES = [(1, 32, 8192), (1, 32, 32768)]


def coverage_flops(b, h, s, d, dv, causal) -> tuple[float, float]:
    """Forward and backward FLOPs with V's own head dim: QK^T at d and PV at d_v forward; backward
    QK^T, dQ, dK at d and dP, dV at d_v (2.5x the forward where they agree, as CONVENTIONS.md §8)."""
    pairs = b * h * s * s / (2 if causal else 1)
    return 2 * pairs * (d + dv), 2 * pairs * (3 * d + 2 * dv)


def _coverage_fns(b, h, s, d, dv, causal, softcap):
    """`{name: fn(i)}`: our forward and forward + backward (delta, dk/dv, dq into float32 accumulators) at
    `softcap`, and FA4's (`flash_attn.cute.flash_attn_func`) where it is installed."""
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_fwd as F

    n = _n_sets(b, h, s, max(d, dv), torch.bfloat16)
    gen = [(torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda"),
            torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda"),
            torch.randn(b, s, h, dv, dtype=torch.bfloat16, device="cuda"),
            torch.randn(b, s, h, dv, dtype=torch.bfloat16, device="cuda")) for _ in range(n)]
    scale = d ** -0.5
    kw = dict(softmax_scale=scale, causal=causal, q_start=0, k_start=0, softcap=softcap)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in gen[0][:3]]

    def fwd(i):
        q, k, v, _ = gen[i % n]
        return F.attention_forward(q, k, v, **kw)

    def fwd_bwd(i):
        q, k, v, do = gen[i % n]
        o, lse = F.attention_forward(q, k, v, **kw)
        B.attention_backward(do, q, k, v, o, lse, B.attention_delta(do, o), **kw, dq_acc=grads[0], dk_acc=grads[1],
                             dv_acc=grads[2])

    fns = {"ours_fwd": fwd, "ours_fwd_bwd": fwd_bwd}
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return fns
    leaves = [tuple(t.detach().requires_grad_() for t in st[:3]) + (st[3],) for st in gen]

    def fa4_fwd(i):
        out = flash_attn_func(*leaves[i % n][:3], softmax_scale=scale, causal=causal, softcap=softcap)
        return out[0] if isinstance(out, tuple) else out

    def fa4_fwd_bwd(i):
        torch.autograd.grad(fa4_fwd(i), leaves[i % n][:3], leaves[i % n][3])

    try:
        fa4_fwd(0)
        fa4_fwd_bwd(0)
    except Exception as err:  # FA4 may refuse a head-dim pair or softcap on this GPU: record that
        print(f"fa4 failed for d{d}/{dv} softcap={softcap}: {type(err).__name__}: {str(err)[:200]}")
        return fns
    return {**fns, "fa4_fwd": fa4_fwd, "fa4_fwd_bwd": fa4_fwd_bwd}


def sink_rows() -> list[dict]:
    """The sinks' speed bar: `ringlse.attention` (backend `triton`, bf16, d 128) with one sink per head over the
    same call without (bar <= 1.02x, forward and forward + backward incl. the sinks' gradient), the two
    launched interleaved (`timing.interleaved_ms`)."""
    import ringlse
    from timing import interleaved_ms

    rows = []
    for (b, h, s) in COVERAGE_SHAPES:
        for causal in (False, True):
            n = _n_sets(b, h, s, 128, torch.bfloat16)
            gen = [tuple(torch.randn(b, s, h, 128, dtype=torch.bfloat16, device="cuda", requires_grad=i < 3)
                         for i in range(4)) for _ in range(n)]
            sinks = torch.randn(h, device="cuda", requires_grad=True)

            def fns(with_sinks: bool):
                kw = dict(causal=causal, backend="triton", sinks=sinks if with_sinks else None)

                def fwd(i):
                    with torch.no_grad():
                        ringlse.attention(*gen[i % n][:3], **kw)

                def fwd_bwd(i):
                    q, k, v, do = gen[i % n]
                    leaves = (q, k, v, sinks) if with_sinks else (q, k, v)
                    torch.autograd.grad(ringlse.attention(q, k, v, **kw), leaves, do)
                return {"fwd": fwd, "fwd_bwd": fwd_bwd}

            off, on = fns(False), fns(True)
            fl_f, fl_b = coverage_flops(b, h, s, 128, 128, causal)
            row = dict(kind="sinks", batch=b, heads=h, seqlen=s, head_dim=128, d_v=128, causal=causal,
                       dtype="bfloat16", fwd_flop=fl_f, fwd_bwd_flop=fl_f + fl_b)
            for part in ("fwd", "fwd_bwd"):
                ms = interleaved_ms({"off": off[part], "on": on[part]})
                row[f"ours_{part}_ms_nosinks"], row[f"ours_{part}_ms"] = ms["off"], ms["on"]
                row[f"ours_{part}_sinks_time_ratio"] = ms["on"] / ms["off"]
            rows.append(row)
            print(f"sinks s{s} {'causal' if causal else 'full  '}: time with/without fwd "
                  f"{row['ours_fwd_sinks_time_ratio']:.3f} fwd+bwd {row['ours_fwd_bwd_sinks_time_ratio']:.3f}", flush=True)
            del gen, off, on
    return rows


def _steady_ms(fns: dict, **kw) -> dict[str, float]:
    """`name -> ms` of each `fn(0)` in its own steady state: the mean of its `timing.abba_ms` readings."""
    from timing import abba_ms

    return {k: sum(v) / len(v) for k, v in abba_ms({k: (lambda f=f: f(0)) for k, f in fns.items()}, **kw).items()}


def coverage_rows(softcap: float) -> list[dict]:
    """The model-coverage speed bars: (1) our time with `softcap` over our time without (d 128; bar <= 1.10x, fwd
    and fwd+bwd; each in its own steady state, `timing.abba_ms`, since the two draw different power per
    cycle; the ratio with launches interleaved, `timing.interleaved_ms`, both at one clock, beside it), FA4's
    alongside; (2) d_qk 192 / d_v 128 against FA4 (forward bar >= 0.9x its TFLOP/s; different kernels:
    `timing.abba_ms`)."""
    from timing import interleaved_ms

    rows = []
    for (b, h, s) in COVERAGE_SHAPES:
        for causal in (False, True):
            fl_f, fl_b = coverage_flops(b, h, s, 128, 128, causal)
            off = _coverage_fns(b, h, s, 128, 128, causal, 0.0)
            on = _coverage_fns(b, h, s, 128, 128, causal, softcap)
            row = dict(kind="softcap", batch=b, heads=h, seqlen=s, head_dim=128, d_v=128, causal=causal,
                       dtype="bfloat16", softcap=softcap, fwd_flop=fl_f, fwd_bwd_flop=fl_f + fl_b)
            for impl in ("ours", "fa4"):
                for part in ("fwd", "fwd_bwd"):
                    if f"{impl}_{part}" not in on:
                        continue
                    sides = {"off": off[f"{impl}_{part}"], "on": on[f"{impl}_{part}"]}
                    # the capped kernel draws less power per cycle, so under the power cap it holds a higher
                    # clock: each side is timed in its own steady state (abba); interleaved launches put both
                    # at one clock, so their ratio is one of cycles (kept beside it)
                    ms = _steady_ms(sides, preheat_s=3.0)
                    row[f"{impl}_{part}_ms_softcap0"], row[f"{impl}_{part}_ms"] = ms["off"], ms["on"]
                    row[f"{impl}_{part}_softcap_time_ratio"] = ms["on"] / ms["off"]
                    ms = interleaved_ms(sides)
                    row[f"{impl}_{part}_softcap_cycle_ratio"] = ms["on"] / ms["off"]
            rows.append(row)
            print(f"softcap {softcap} s{s} {'causal' if causal else 'full  '}: ours time on/off fwd "
                  f"{row['ours_fwd_softcap_time_ratio']:.3f} fwd+bwd {row['ours_fwd_bwd_softcap_time_ratio']:.3f} "
                  f"(one clock: {row['ours_fwd_softcap_cycle_ratio']:.3f}, {row['ours_fwd_bwd_softcap_cycle_ratio']:.3f})"
                  + (f" | fa4 fwd {row['fa4_fwd_softcap_time_ratio']:.3f}" if "fa4_fwd_ms" in row else ""), flush=True)
            del off, on
            fl_f, fl_b = coverage_flops(b, h, s, 192, 128, causal)
            fns = _coverage_fns(b, h, s, 192, 128, causal, 0.0)
            ms = _steady_ms(fns, warmup_ms=500, preheat_s=2.0)
            row = dict(kind="d_v", batch=b, heads=h, seqlen=s, head_dim=192, d_v=128, causal=causal,
                       dtype="bfloat16", softcap=0.0, fwd_flop=fl_f, fwd_bwd_flop=fl_f + fl_b)
            for name, t in ms.items():
                row[f"{name}_ms"] = t
                row[f"{name}_tflops"] = (fl_f if name.endswith("_fwd") else fl_f + fl_b) / t / 1e9
            if "fa4_fwd" in ms:
                row["fwd_tflops_ratio_vs_fa4"] = ms["fa4_fwd"] / ms["ours_fwd"]
                row["fwd_bwd_tflops_ratio_vs_fa4"] = ms["fa4_fwd_bwd"] / ms["ours_fwd_bwd"]
            rows.append(row)
            print(f"d192/128 s{s} {'causal' if causal else 'full  '}: ours fwd {row['ours_fwd_tflops']:.0f} "
                  f"fwd+bwd {row['ours_fwd_bwd_tflops']:.0f} TFLOP/s"
                  + (f" | fa4 fwd {row['fa4_fwd_tflops']:.0f} fwd+bwd {row['fa4_fwd_bwd_tflops']:.0f} "
                     f"(ours/fa4 fwd {row['fwd_tflops_ratio_vs_fa4']:.2f})" if "fa4_fwd" in ms else ""), flush=True)
            del fns
    return rows


def run_bench(args) -> None:
    import triton
    from torch.nn.attention import SDPBackend

    shapes = [] if args.coverage_only else (QUICK_SHAPES if args.quick else FULL_SHAPES)
    gpu = torch.cuda.get_device_name(0)
    rows = []
    for (b, h, s, d, hkv) in shapes:
        for causal in (False, True):
            fl = attn_flops(b, h, s, s, d, causal)
            ours = time_ours(b, h, s, d, causal, which=("fwd", "merge", "bwd"), hkv=hkv)
            peers = {"sdpa_flash": time_sdpa(b, h, s, d, causal, SDPBackend.FLASH_ATTENTION, hkv=hkv)}
            try:
                peers["cudnn"] = time_sdpa(b, h, s, d, causal, SDPBackend.CUDNN_ATTENTION, hkv=hkv)
            except Exception as err:  # cuDNN SDPA may refuse a shape; record that
                print(f"cudnn failed for {(b, h, s, d, hkv, causal)}: {err}")
                peers["cudnn"] = {"fwd": float("nan"), "bwd": float("nan")}
            fa4 = time_fa4(b, h, s, d, causal, hkv=hkv)
            if fa4 is not None:
                peers["fa4"] = fa4
            row = dict(batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d, causal=causal, dtype="bfloat16",
                       fwd_flop=fl, bwd_flop=2.5 * fl, ours_fwd_kernel=_forward_kernel_name(d, hkv))
            for name, r in (("ours", ours), *peers.items()):
                row[f"{name}_fwd_ms"] = r["fwd"]
                row[f"{name}_bwd_ms"] = r["bwd"]
                row[f"{name}_fwd_tflops"] = fl / r["fwd"] / 1e9
                row[f"{name}_bwd_tflops"] = 2.5 * fl / r["bwd"] / 1e9
            row["ours_fwd_merge_ms"] = ours["fwd_merge"]
            row["ours_fwd_merge_tflops"] = fl / ours["fwd_merge"] / 1e9
            row["merge_fwd_time_ratio"] = ours["fwd_merge_ratio"]
            for peer in peers:
                row[f"fwd_ratio_vs_{peer}"] = row[f"{peer}_fwd_ms"] / row["ours_fwd_ms"]
                row[f"bwd_ratio_vs_{peer}"] = row[f"{peer}_bwd_ms"] / row["ours_bwd_ms"]
            rows.append(row)
            fa4_txt = (f" fa4 {row['fa4_fwd_tflops']:4.0f}/{row['fa4_bwd_tflops']:4.0f}" if "fa4" in peers else "")
            print(f"b{b} h{h}/{hkv} s{s:>5} d{d:>3} {'causal' if causal else 'full  '} | fwd ours "
                  f"{row['ours_fwd_tflops']:4.0f} (+merge {row['ours_fwd_merge_tflops']:4.0f}) fa2 "
                  f"{row['sdpa_flash_fwd_tflops']:4.0f} cudnn {row['cudnn_fwd_tflops']:4.0f} | bwd ours "
                  f"{row['ours_bwd_tflops']:4.0f} fa2 {row['sdpa_flash_bwd_tflops']:4.0f} cudnn "
                  f"{row['cudnn_bwd_tflops']:4.0f} TFLOP/s{fa4_txt}", flush=True)
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_fwd as F

    result = dict(
        gpu=gpu, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        method="triton.testing.do_bench median (warmup 50 ms, rep 300 ms); inputs rotate among 3 sets when one "
               "set is under 2x L2; FLOPs 4*B*H*S*S*D (halved causal), backward 2.5x; the merge column: the plain "
               "and merging forwards' launches interleaved (timing.interleaved_ms), medians; coverage rows: softcap on and "
               "off each in its own steady state (timing.abba_ms, mean of both orders), *_softcap_cycle_ratio with "
               "their launches interleaved (one clock for both); sinks on and off interleaved",
        ours_backward_includes="delta kernel + dk/dv kernel + dq kernel, adding into float32 accumulators",
        tuned_by_sweep_in_this_run=bool(args.sweep),
        configs={str(d): dict(fwd={str(c): asdict(F.fwd_configs(d, torch.bfloat16, c)[0]) for c in (False, True)},
                              bwd={str(c): asdict(B.bwd_configs(d, torch.bfloat16, c)[0]) for c in (False, True)})
                 for d in sorted({s[3] for s in shapes})},
        coverage_rows=coverage_rows(args.softcap) + sink_rows() if args.coverage or args.coverage_only else [],
        hopper_configs={f"d{d} {'causal' if c else 'full'}": asdict(cfg) for (d, c), cfg in _hopper_configs().items()},
        peer_figures_design_s9=PEER_FIGURES_H200,
        rows=rows,
    )
    # the model-coverage rows alone are a benchmark of their own (softcap, sinks, d 192/128 vs FA4)
    path = save_result(args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                       "softcap_dv" if args.coverage_only else "block_attention", result)
    print("\nratios (peer time / ours, higher is better)")
    print(f"{'shape':<30}{'fwd/FA2':>9}{'bwd/FA2':>9}{'fwd/cuDNN':>11}{'bwd/cuDNN':>11}{'fwd/FA4':>9}{'bwd/FA4':>9}"
          f"{'merge':>7}")
    for r in rows:
        name = (f"b{r['batch']} h{r['heads']}/{r['kv_heads']} s{r['seqlen']} d{r['head_dim']} "
                f"{'c' if r['causal'] else 'n'}")
        fa4 = f"{r['fwd_ratio_vs_fa4']:>9.2f}{r['bwd_ratio_vs_fa4']:>9.2f}" if "fwd_ratio_vs_fa4" in r else " " * 18
        print(f"{name:<30}{r['fwd_ratio_vs_sdpa_flash']:>9.2f}{r['bwd_ratio_vs_sdpa_flash']:>9.2f}"
              f"{r['fwd_ratio_vs_cudnn']:>11.2f}{r['bwd_ratio_vs_cudnn']:>11.2f}{fa4}{r['merge_fwd_time_ratio']:>7.3f}")
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--out", default=None, help="directory for the results JSON (default benchmarks/results)")
    p.add_argument("--sweep", action="store_true", help="time candidate tile configs instead")
    p.add_argument("--bench", action="store_true", help="with --sweep: then benchmark with the winners")
    p.add_argument("--aot", action="store_true", help="no GPU: compile for sm_90 and print registers/spills")
    p.add_argument("--precompile", type=int, default=0, metavar="N", help="compile in N processes first")
    p.add_argument("--skip-bench", action="store_true", help="only precompile")
    p.add_argument("--coverage", action="store_true",
                   help="also time the model-coverage rows: softcap on vs off, d_qk 192 / d_v 128 vs FA4 (coverage_rows)")
    p.add_argument("--coverage-only", action="store_true", help="only the --coverage rows")
    p.add_argument("--softcap", type=float, default=30.0, help="the cap the coverage rows time (Gemma 2's 30)")
    args = p.parse_args()
    if args.aot:
        run_aot(args)
        return
    if args.precompile:
        shapes = SWEEP_SHAPES if args.sweep else (QUICK_SHAPES if args.quick else FULL_SHAPES)
        precompile(args.precompile, shapes, args.sweep)
        if args.skip_bench:
            return
    if args.sweep:
        run_sweep(args)
        if args.bench:
            run_bench(args)
    else:
        run_bench(args)


if __name__ == "__main__":
    main()
