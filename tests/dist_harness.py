"""Spawn W gloo ranks with a file rendezvous (no ports) and a hard deadline, so a deadlock fails the
test instead of hanging CI."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def _entry(fn: Callable, rank: int, world: int, rdzv: str, results, args: tuple, backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # W ranks share 2 cores
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=rdzv, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
        )
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, tmp_path: Path, *args, timeout: float = 240.0, backend: str = "gloo") -> list:
    """Run `fn(rank, world, *args)` on `world` spawned ranks (gloo on CPU; `backend="nccl"`: rank r on
    GPU r); return the per-rank results.

    Raises AssertionError with the rank's traceback if any rank fails, or if they do not all finish
    within `timeout` seconds (the processes are killed).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rdzv = f"file://{tmp_path / f'rdzv-{world}-{os.getpid()}-{id(fn)}-{time.monotonic_ns()}'}"
    procs = [ctx.Process(target=_entry, args=(fn, r, world, rdzv, results, args, backend), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"ranks did not finish within {timeout:.0f} s (deadlock?); done: {sorted(out)}")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                    codes = [p.exitcode for p in procs]
                    raise AssertionError(f"a rank died without reporting (exit codes {codes})") from None
                continue
            if status == "ok":
                out[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
        if errors:
            raise AssertionError("\n".join(errors))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
