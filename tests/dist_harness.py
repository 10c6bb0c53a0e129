"""Start W gloo ranks with a file rendezvous (no ports) and a hard deadline, so a deadlock fails the
test instead of hanging CI.

`run_ranks` starts the ranks for one function; `RankPool` keeps W ranks (and their process group)
alive between calls, for tests that run many small cases (hypothesis examples, thousands of ring
calls) without paying for a start each. Fault tests let ranks die (`may_exit`) and leave with
`hard_exit`: a rank whose peers died or stalled may otherwise block in `destroy_process_group` until
its gloo threads give up (the group's timeout)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Collection
from pathlib import Path


def _init(rank: int, world: int, rdzv: str, backend: str, pg_timeout: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # W ranks share 2 cores
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=rdzv, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=pg_timeout)
    )


def _leave(results, hard_exit: bool) -> None:
    import torch.distributed as dist

    if hard_exit:  # flush what was reported, then go without tearing down the group
        results.close()
        results.join_thread()
        os._exit(0)
    if dist.is_initialized():
        dist.destroy_process_group()


def _context(backend: str):
    """gloo ranks fork from a server that has imported torch and ringlse once (each spawned rank spent
    about 1.6 s of the 2-core CI machine importing them); NCCL ranks are spawned, since a process forked
    after the driver was touched cannot use CUDA."""
    if backend != "gloo":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ringlse"])
    return ctx


def _take_env(env: dict[str, str]) -> None:
    """The parent's environment as it is now (a forked rank would otherwise see the fork server's, made
    when the first ranks started)."""
    os.environ.clear()
    os.environ.update(env)


def _entry(fn: Callable, rank: int, world: int, rdzv: str, results, args: tuple, backend: str,
           env: dict[str, str], pg_timeout: float = 120.0, hard_exit: bool = False) -> None:
    try:
        _take_env(env)
        _init(rank, world, rdzv, backend, pg_timeout)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        _leave(results, hard_exit)


def _rdzv(tmp_path: Path, world: int, tag: object) -> str:
    return f"file://{tmp_path / f'rdzv-{world}-{os.getpid()}-{id(tag)}-{time.monotonic_ns()}'}"


def _collect(results, procs, needed: Collection[int], timeout: float, what: str) -> dict[int, object]:
    """The results of the ranks in `needed` (others' too, where they arrive first); AssertionError with
    their tracebacks if any failed, died, or did not report within `timeout` seconds (after a rank
    failed, the others get 10 s more: they may be stuck waiting for it)."""
    out: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while not set(needed) <= set(out) | set(errors):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if errors:
                break
            raise AssertionError(f"ranks did not finish {what} within {timeout:.0f} s (deadlock?); done: {sorted(out)}")
        try:
            rank, status, payload = results.get(timeout=min(remaining, 5.0))
        except queue.Empty:
            dead = [r for r in needed if r not in out and r not in errors and procs[r].exitcode is not None]
            if dead and results.empty():
                codes = [p.exitcode for p in procs]
                raise AssertionError(f"rank(s) {dead} died without reporting (exit codes {codes})") from None
            continue
        if status == "ok":
            out[rank] = payload
        else:
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + 10.0)
    if errors:
        raise AssertionError("\n".join(f"rank {r}:\n{text}" for r, text in sorted(errors.items())))
    return out


def run_ranks(fn: Callable, world: int, tmp_path: Path, *args, timeout: float = 240.0, backend: str = "gloo",
              pg_timeout: float = 120.0, may_exit: Collection[int] = (), hard_exit: bool = False) -> list:
    """Run `fn(rank, world, *args)` on `world` spawned ranks (gloo on CPU; `backend="nccl"`: rank r on
    GPU r) in a process group with timeout `pg_timeout` seconds; return the per-rank results.

    Ranks in `may_exit` may end without reporting (a test that makes them die or stall): their result
    is None, and once every other rank has reported they are killed. `hard_exit`: ranks leave with
    `os._exit` after reporting instead of destroying the process group.

    Raises AssertionError with the rank's traceback if any rank fails, or if they do not all finish
    within `timeout` seconds (the processes are killed).
    """
    ctx = _context(backend)
    results = ctx.Queue()
    rdzv = _rdzv(tmp_path, world, fn)
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world, rdzv, results, args, backend, env, pg_timeout, hard_exit),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    needed = [r for r in range(world) if r not in may_exit]
    try:
        out = _collect(results, procs, needed, timeout, getattr(fn, "__name__", "their work"))
    finally:
        for r in may_exit:
            if procs[r].is_alive():
                procs[r].kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out.get(r) for r in range(world)]


def _pool_entry(rank: int, world: int, rdzv: str, tasks, results, pg_timeout: float, env: dict[str, str]) -> None:
    _take_env(env)
    try:
        _init(rank, world, rdzv, "gloo", pg_timeout)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, "ok", fn(rank, world, *args)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    _leave(results, False)


class RankPool:
    """`world` gloo ranks that stay up between calls: `pool.run(fn, *args)` runs
    `fn(rank, world, *args)` on every rank, in the same process group each time, and returns the
    per-rank results (AssertionError as `run_ranks` when a rank fails or they do not finish). A run
    that times out leaves the pool unusable (later runs fail at once). `env` is set in each rank
    before its process group is made. Use as a context manager."""

    def __init__(self, world: int, tmp_path: Path, pg_timeout: float = 120.0, env: dict[str, str] | None = None):
        ctx = _context("gloo")
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        rdzv = _rdzv(tmp_path, world, self)
        self.procs = [ctx.Process(target=_pool_entry,
                                  args=(r, world, rdzv, self.tasks[r], self.results, pg_timeout,
                                        {**os.environ, **(env or {})}),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken: str | None = None

    def run(self, fn: Callable, *args, timeout: float = 120.0) -> list:
        if self.broken:
            raise AssertionError(f"the rank pool is unusable: {self.broken}")
        for t in self.tasks:
            t.put((fn, args))
        try:
            out = _collect(self.results, self.procs, range(self.world), timeout, getattr(fn, "__name__", "their work"))
        except AssertionError as e:
            self.broken = str(e).splitlines()[0]
            raise
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        for t in self.tasks:
            t.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
