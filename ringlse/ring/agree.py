"""The agreement before any K/V moves: every rank of the ring posts a row of integers describing its
inputs (shapes, dtype, options) and its own error if it has one; then every rank raises the same
ValueError when any rank's inputs are bad or two ranks disagree, or goes on together.

One path: a gloo all-gather over the ring's ranks (the ring's own group when it is gloo, else a gloo
group of the same ranks made once). It runs on the host, so it waits for no kernel, and a caller can
queue local work before it checks. It waits no longer than the process group's timeout, and gloo
reports a peer that is gone as an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


class Agreement:
    """The pending comparison of the ranks' rows: `ready()` says whether every rank's row is in
    (without waiting); calling it waits for them and raises ValueError on every rank when any rank
    reported an error or two ranks' rows differ."""

    def __init__(self, ready: Callable[[], bool], check: Callable[[], None]):
        self.ready = ready
        self._check = check

    def __call__(self) -> None:
        self._check()


def post_agreement(rank: int, world: int, host_group: dist.ProcessGroup | None, meta: Sequence[int],
                   error: str | None) -> Agreement:
    """Start comparing `meta` (ints describing this rank's inputs) and its local `error` across the
    `world` ranks of the gloo `host_group` (None: the default group); returns the pending `Agreement`.
    Every rank must call this once per ring call, whatever its inputs."""
    if world == 1:
        return Agreement(lambda: True, lambda: decide([[0 if error is None else 1, *meta]], 0, error))
    row = torch.tensor([0 if error is None else 1, *meta], dtype=torch.int64)
    table = torch.empty((world, row.numel()), dtype=torch.int64)
    work = dist.all_gather(list(table.unbind(0)), row, group=host_group, async_op=True)

    def check() -> None:
        work.wait()
        decide(table.tolist(), rank, error)

    return Agreement(work.is_completed, check)


def decide(rows: list[list[int]], rank: int, error: str | None) -> None:
    """Raise the same ValueError on every rank if any row carries an error flag or the rows differ
    (this rank's own error message, where it has one)."""
    if error is not None:
        raise ValueError(f"rank {rank}: {error}")
    bad = [r for r, row in enumerate(rows) if row[0] != 0]
    if bad:
        raise ValueError(f"rank {rank}: ranks {bad} reported invalid input (see their errors)")
    mine = rows[rank][1:]
    differs = [r for r, row in enumerate(rows) if row[1:] != mine]
    if differs:
        raise ValueError(
            f"rank {rank}: ranks disagree on shapes/dtype/options: mine {mine}, "
            + ", ".join(f"rank {r} {rows[r][1:]}" for r in differs)
        )
