"""How the benchmarks time kernels against each other when the GPU's clock will not hold still.

Under a sustained load an H100/H200 runs at its power cap (700 W), and the clock that cap allows falls as
the card warms: the same forward read 1530 then 1485 MHz twelve seconds apart, a backward 1747 then 1575
So a kernel timed after another has run for a while reads slower than it would first: timed right
after our dense causal block, the same block read 0.89x of itself on an H100. Two remedies, for two
questions:
- `interleaved_ms`: launches interleaved A B A B, for versions of one kernel (an A/B of a change);
- `abba_ms`: the card warmed first by all sides in turn; then each side in its own steady state (2 s of
  that side alone before it is timed), the whole list timed in order and in reverse, each side the mean
  of its readings: a drift linear in time cancels. For different kernels (a masked block against the
  dense one, ours against a peer). With 500 ms of warm-up the readings still followed what ran before:
  FA4's 1K-window forward read 1.10 ms after a memset and 1.22 ms after its backward (H100):
  the power cap's controller remembers about a second.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
from triton.testing import do_bench


def interleaved_ms(fns: dict, budget_s: float = 3.0, max_rounds: int = 200) -> dict[str, float]:
    """Median ms of each of `fns` (name -> `fn(i)`), their launches interleaved A B C A B C ..., each
    timed by its own CUDA events after an L2 flush (as `do_bench` does for one function). Timing the
    sides in turn, one `do_bench` each, let identical kernels differ by up to 3% (the GPU's clock drifts
    over seconds); interleaved, the drift hits every side alike (A/A: x0.999-1.001). For kernels of
    similar power draw (A/B of one kernel's versions): a light kernel right after a heavy one starts at
    the clock the heavy one left (masked_attention.py times apart). Rounds: as many as fit `budget_s`."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for fn in fns.values():
        fn(0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for fn in fns.values():
        fn(0)
    torch.cuda.synchronize()
    rounds = max(10, min(max_rounds, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
    names = list(fns)
    events = {name: [] for name in names}
    for r in range(rounds):
        for j in range(len(names)):
            # the order rotates every round: no side always follows the same one
            name = names[(r + j) % len(names)]
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name](r)
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: float(torch.tensor([s.elapsed_time(e) for s, e in ev]).median()) for name, ev in events.items()}


def abba_ms(fns: dict, warmup_ms: int = 2000, rep_ms: int = 300, passes: int = 1,
            preheat_s: float = 5.0) -> dict[str, list[float]]:
    """`name -> readings (ms)` for each of `fns` (name -> `fn()`): first `preheat_s` of all of them in
    turn (the card warms to where a long run keeps it), then `passes` times the list in order and in
    reverse, every side `do_bench`'s median after `warmup_ms` of it alone. The mean of a side's readings
    cancels a drift linear in time; their spread shows what drift there was."""
    names = list(fns)
    end = time.perf_counter() + preheat_s
    while time.perf_counter() < end:
        for name in names:
            fns[name]()
        torch.cuda.synchronize()
    readings = {name: [] for name in names}
    for _ in range(passes):
        for order in (names, names[::-1]):
            for name in order:
                readings[name].append(do_bench(fns[name], warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return readings


def environment(world: int) -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "gpus": world,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "command": "torchrun --nproc_per_node={} {}".format(world, " ".join(sys.argv)),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))},
        "nccl_high_priority_streams": True,  # init_process_group(pg_options=ringlse.nccl_options())
    }
