"""The LSE toolkit's private launcher against Triton's own launch, side by side in one process
(`python benchmarks/lse_toolkit.py --launch-ab`, or this file directly).

Why: `ringlse.lse.kernels.launch` calls Triton 3.6's compiled launchers directly (its `FAST_PATH`), which
ties the toolkit to one Triton release; it stays only if it buys at least 10% on a call a user makes.
So this times the public functions (`ringlse.softmax`, `log_softmax`, `logsumexp`, forward and forward +
backward through autograd, and `log_bmm`) at shapes users run, with `FAST_PATH` on and off by turns
(off: every launch is `kernel[grid](...)`, exactly what the toolkit would do without the launcher).
`log_bmm` launches through Triton in both modes: its rows are the control (ratio ~1).

Two timings per case and mode, host time included (no CUDA graphs):
- `loop_us` (the verdict's): wall time per call of a loop of back-to-back calls ended by one
  synchronize, as a training or inference loop sees it (host-bound calls: the host's time; large
  ones: the GPU's); median of `REPEATS` loops, the modes taking turns loop by loop, so that the GPU's
  clock drift hits both alike;
- `do_bench_us`: `triton.testing.do_bench`'s median, as `lse_toolkit.py` times (its L2 flush before
  each call hides host time up to the flush's length).

Verdict: `saving = 1 - fast / triton` of `loop_us` per case; `keep_fast_launcher` is true iff some
case other than the control saves at least `BAR` (10%). The control's savings (`control_saving_range`)
show the noise of the measurement: a verdict within that much of the bar is no verdict.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import torch
import triton
from triton.testing import do_bench

import ringlse
from ringlse.lse.kernels import launch as launcher

BAR = 0.10
REPEATS = 15
LOOP_MS = 20.0  # each timed loop runs about this long (at least MIN_CALLS calls)
MIN_CALLS = 20

# (rows, cols, dtype): vocabulary logits (training batch, a decode step), attention-like rows, small
# host-bound calls, and the benchmark's launch-bound long rows
SHAPES = [(4096, 32000, torch.float32), (4096, 32000, torch.bfloat16), (32, 32000, torch.bfloat16),
          (1024, 4096, torch.float32), (8, 1024, torch.float32), (64, 1024, torch.bfloat16),
          (8, 131072, torch.float32)]
OPS = ("softmax", "log_softmax", "logsumexp")
LOG_BMM = [(8, 128, 256, 64), (4, 512, 512, 512)]  # (B, N, M, P): the README's example and a larger one


def summarize(result: dict) -> None:
    """The verdict over `result["cases"]` (also for a file whose run was cut short): `best`,
    `control_saving_range`, `savings`, `keep_fast_launcher`, `verdict`."""
    done = [r for r in result["cases"] if "error" not in r]
    # (a case whose calls the launcher makes no launch of cannot be bought anything by it)
    users = [r for r in done if not r.get("control") and r["launcher_launches_per_call"]]
    best = max(users, key=lambda r: r["saving"])
    control = [r["saving"] for r in done if r.get("control")]
    result["best"] = {k: best[k] for k in ("op", "shape", "dtype", "direction", "loop_us", "saving")}
    result["control_saving_range"] = [min(control), max(control)] if control else None
    result["savings"] = [  # every case, largest saving first: the table to read
        f"{r['saving']:+.1%} {r['op']} {'x'.join(map(str, r['shape']))} {r['dtype']} {r['direction']}"
        f"{' (control)' if r.get('control') else ''}: {r['loop_us']['fast']:.1f} vs {r['loop_us']['triton']:.1f} us"
        for r in sorted(done, key=lambda r: -r["saving"])]
    result["keep_fast_launcher"] = best["saving"] >= BAR
    result["verdict"] = (
        f"keep the launcher: {best['saving']:.1%} saved on {best['op']} {best['shape']} {best['dtype']} "
        f"{best['direction']} (bar {BAR:.0%})" if result["keep_fast_launcher"] else
        f"drop the launcher: at most {best['saving']:.1%} saved ({best['op']} {best['shape']} {best['dtype']} "
        f"{best['direction']}; bar {BAR:.0%})")


def _set_fast(on: bool) -> None:
    launcher.FAST_PATH = on  # (read at every launch)


def _cases() -> list[dict]:
    """name, fn, launcher-made launches per call, and the tensors it keeps alive."""
    cases = []
    for rows, cols, dtype in SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=dtype) * 3
        xg = x.clone().requires_grad_()
        for op in OPS:
            fn = getattr(ringlse, op)
            y = fn(x)
            g = torch.randn_like(y)
            base = dict(op=op, shape=[rows, cols], dtype=str(dtype).removeprefix("torch."))
            cases.append(dict(base, direction="fwd", fn=lambda fn=fn, x=x: fn(x)))
            cases.append(dict(base, direction="fwd+bwd (autograd)",
                              fn=lambda fn=fn, xg=xg, g=g: torch.autograd.grad(fn(xg), xg, g)))
    for B, N, M, P in LOG_BMM:
        a = torch.randn(B, N, M, device="cuda")
        b = torch.randn(B, M, P, device="cuda")
        ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
        g = torch.randn(B, N, P, device="cuda")
        base = dict(op="log_bmm", shape=[B, N, M, P], dtype="float32", control=True)
        cases.append(dict(base, direction="fwd", fn=lambda a=a, b=b: ringlse.log_bmm(a, b)))
        cases.append(dict(base, direction="fwd+bwd (autograd)",
                          fn=lambda ag=ag, bg=bg, g=g: torch.autograd.grad(ringlse.log_bmm(ag, bg), (ag, bg), g)))
    return cases


def _loop_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def measure(case: dict) -> dict:
    fn = case["fn"]
    for on in (True, False):  # warm both paths (compiles, caches, allocator)
        _set_fast(on)
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    with launcher.recorded_launches() as seen:
        fn()
    calls = max(MIN_CALLS, int(LOOP_MS * 1e3 / max(_loop_us(fn, 5), 1.0)))
    loops = {"fast": [], "triton": []}
    for r in range(REPEATS):
        for mode in (("fast", "triton") if r % 2 == 0 else ("triton", "fast")):
            _set_fast(mode == "fast")
            loops[mode].append(_loop_us(fn, calls))
    bench = {"fast": [], "triton": []}
    for mode in ("fast", "triton", "triton", "fast"):
        _set_fast(mode == "fast")
        bench[mode].append(do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3)
    _set_fast(True)
    rec = {k: v for k, v in case.items() if k != "fn"}
    rec["launcher_launches_per_call"] = len(seen)
    rec["calls_per_loop"] = calls
    rec["loop_us"] = {m: _median(v) for m, v in loops.items()}
    rec["loop_us_spread"] = {m: [min(v), max(v)] for m, v in loops.items()}
    rec["do_bench_us"] = {m: sum(v) / len(v) for m, v in bench.items()}
    rec["saving"] = 1 - rec["loop_us"]["fast"] / rec["loop_us"]["triton"]
    rec["do_bench_saving"] = 1 - rec["do_bench_us"]["fast"] / rec["do_bench_us"]["triton"]
    return rec


def launch_ab(out_dir: str) -> dict:
    gpu = torch.cuda.get_device_name()
    result = {
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "fast_path_available": launcher.FAST_PATH,
        "method": __doc__, "bar": BAR, "cases": [],
    }
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"lse_launch-{slug}.json")
    if not launcher.FAST_PATH:
        result["verdict"] = f"no fast path on Triton {triton.__version__}: nothing to compare"
    else:
        for case in _cases():
            try:
                rec = measure(case)
            except Exception as e:  # a case that fails is data too; the others still run
                rec = {k: v for k, v in case.items() if k != "fn"}
                result["cases"].append(dict(rec, error=repr(e)[:300]))
                print(f"{rec['op']} {rec['shape']} {rec['dtype']} {rec['direction']}: {e!r}"[:300], flush=True)
                continue
            finally:
                _set_fast(True)
            result["cases"].append(rec)
            print(f"{rec['op']:12s}{'x'.join(map(str, rec['shape'])):>18s} {rec['dtype']:9s}{rec['direction']:20s}"
                  f" loop fast {rec['loop_us']['fast']:9.1f} us  triton {rec['loop_us']['triton']:9.1f} us"
                  f"  saving {rec['saving']:+6.1%}  (do_bench {rec['do_bench_saving']:+6.1%},"
                  f" {rec['launcher_launches_per_call']} launches)", flush=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
        summarize(result)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(result["verdict"])
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    launch_ab(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results"))
