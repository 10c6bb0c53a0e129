"""A small int64 table in host shared memory, written and read by the ranks of a group on one host.

The ring's agreement on inputs (`RingComm.post_agreement`) gathers a row of integers from every rank
before any K/V moves. As a gloo gather that is a host round trip over TCP whose latency varied from
0.07 to 1.7 ms between calls on a 4xH200 host (`benchmarks/NOTES.md`), and the first K/V transfer
of each call waits for it. Through this table it costs what the ranks' arrival times differ by:
each rank writes its row and a call number into its own slot and reads the others' until they show
the same call number.

Slots are doubled by call parity: a rank can write call c + 2 (parity of c) only after every rank
posted call c + 1, which each does only after it finished reading call c. Rows are written before
their call number; x86-64 keeps stores in order (other CPUs do not, and use the gloo gather).
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

# the longest a rank waits for the others before it raises (a rank that never calls would otherwise
# leave the rest waiting forever; gloo's default timeout is the same)
TIMEOUT_S = 1800.0
_SPINS_BEFORE_SLEEP = 2000  # ~ a few ms of polling, then 0.1 ms sleeps between polls


_PATH_BYTES = 4096  # room for the table's file name in the broadcast


def _broadcast_path(path: str | None, root: int, group: dist.ProcessGroup | None) -> str | None:
    """The root's `path` (None: no table) on every rank of `group`, as bytes in an int64 tensor
    (object collectives need numpy, which a base install lacks)."""
    buf = torch.zeros(_PATH_BYTES + 1, dtype=torch.int64)
    if path is not None:
        raw = os.fsencode(path)
        if len(raw) <= _PATH_BYTES:
            buf[0] = len(raw)
            buf[1 : 1 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    dist.broadcast(buf, src=root, group=group)
    n = int(buf[0])
    return os.fsdecode(bytes(buf[1 : 1 + n].tolist())) if n else None


class SharedTable:
    """`[2, world, cols]` int64 in memory shared by the group's ranks: slot `[seq % 2, rank]` holds
    `[seq, row...]`. Made by `create` (collective)."""

    def __init__(self, table: torch.Tensor, rank: int):
        self.table = table
        self.rank = rank
        self.cols = table.shape[2] - 1

    @classmethod
    def create(cls, group: dist.ProcessGroup, rank: int, root: int, cols: int) -> SharedTable | None:
        """A table for rows of up to `cols` integers, or None where the ranks of the gloo `group`
        cannot share one (other hosts, another CPU architecture, separate /dev/shm): every rank gets
        the same answer. Collective over `group`; `root` is the global rank of its rank 0."""
        world = dist.get_world_size(group)
        ok = platform.machine().lower() in ("x86_64", "amd64")
        path = None
        if rank == 0 and ok:
            fd, path = tempfile.mkstemp(prefix="ringlse-agreement-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            if path is not None:
                os.ftruncate(fd, 2 * world * (cols + 1) * 8)
                os.close(fd)
            path = _broadcast_path(path, root, group)
            table = None
            try:
                if ok and path is not None:
                    table = torch.from_file(path, shared=True, size=2 * world * (cols + 1), dtype=torch.int64)
                    table = table.view(2, world, cols + 1)
                    table[1, rank, 0] = rank + 1
            except (OSError, RuntimeError):
                table = None
            dist.barrier(group=group)
            # shared iff every rank sees every other rank's mark (a rank whose /dev/shm is not the root's
            # opened a file of its own); the all-reduce also means everyone has read the marks
            seen = table is not None and table[1, :, 0].tolist() == list(range(1, world + 1))
            flag = torch.tensor([int(seen)], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        finally:
            if path is not None:
                try:
                    os.unlink(path)  # the mappings stay; nothing is left in /dev/shm, on error too
                except FileNotFoundError:
                    pass  # another rank of this host removed it first
        if not flag.item():
            return None
        table[1, rank, 0] = 0
        dist.barrier(group=group)
        return cls(table, rank)

    def post(self, seq: int, row: Sequence[int]) -> None:
        """Write this rank's `row` for call `seq` (>= 1; calls numbered alike on every rank)."""
        if len(row) > self.cols:
            raise ValueError(f"SharedTable: a row of {len(row)} integers, the table holds {self.cols}")
        slot = self.table[seq % 2, self.rank]
        slot[1:] = 0
        slot[1 : 1 + len(row)] = torch.tensor(row, dtype=torch.int64)
        slot[0] = seq  # last: a reader that sees the call number sees the row

    def arrived(self, seq: int) -> bool:
        """Whether every rank has posted call `seq` (no waiting)."""
        return all(s == seq for s in self.table[seq % 2, :, 0].tolist())

    def gather(self, seq: int, timeout_s: float = TIMEOUT_S) -> list[list[int]]:
        """Every rank's row of call `seq` (padded with zeros), once all are posted.

        Raises:
            RuntimeError: some rank did not post within `timeout_s`.
        """
        spins, deadline = 0, None
        while not self.arrived(seq):
            spins += 1
            if spins < _SPINS_BEFORE_SLEEP:
                continue
            now = time.monotonic()
            deadline = deadline or now + timeout_s
            if now > deadline:
                late = [r for r, s in enumerate(self.table[seq % 2, :, 0].tolist()) if s != seq]
                raise RuntimeError(f"ring agreement: ranks {late} did not reach call {seq} within {timeout_s:.0f} s")
            time.sleep(1e-4)
        return [row[1:] for row in self.table[seq % 2].tolist()]
