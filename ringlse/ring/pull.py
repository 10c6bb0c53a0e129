"""K/V blocks pulled from the other GPUs' memory by copy engines, for rings within one host.

NCCL moves data with kernels: beside an attention kernel that holds every SM, its transfers of the
ring's K/V waited for SMs (on 4xH200 a 128 MiB block took 1.2 ms beside the cuDNN forward, 0.45 ms
alone). Copy engines need no SM. Each rank publishes its packed K/V in a
buffer of PyTorch's symmetric memory (mapped into every rank of the group by CUDA IPC), and at step
s copies the rows it will read of rank (rank - s)'s block straight from that buffer: a
`cudaMemcpyAsync` between GPUs, run by a copy engine. Blocks come from their owner, not from the
neighbour, so no transfer waits for another, and a zigzag rank that only sees the first half of a
block pulls only that half.

Synchronisation: on one high-priority side stream per device, K/V are packed straight into our
buffer (two regions, alternate calls; see `PulledKV`), then a GPU-side barrier of the group (every
buffer is published) and the pulls, each waiting only for the last reader of the local buffer it
fills. The compute stream waits for a pull's event; it never waits for the packing (its own block
reads K and V where they are), so the packing overlaps the rank's first attention kernel.

Used when every rank of an NCCL group is on this host (`use_copy_engines`); `RINGLSE_KV_TRANSPORT=
nccl` turns it off, `=copy` insists on it.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
import time

import torch
import torch.distributed as dist

from ringlse.kv_pack import KVPack
from ringlse.ring.comm import Pending, current_stream

# Workspaces live on the group's `RingComm` (`pull_workspaces`: device -> [buffer, handle, calls
# published, {(rank, pack, dtype, offset): (flat buffer, (k, v) views)}]; outgrown ones in
# `retired_workspaces`, since peers may still read them), so they are freed when the group is destroyed.
# The side streams are per device and role (K/V pulls here; the dk/dv messages' sends and receives in
# `ringlse.ring.dkv_pull`).
_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def _symm_mem():
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    return symm_mem if hasattr(symm_mem, "rendezvous") and hasattr(symm_mem, "empty") else None


def use_copy_engines(comm) -> bool:
    """Whether the ring's K/V should be pulled by copy engines: an NCCL group whose ranks share one
    host, torch with symmetric memory, and `RINGLSE_KV_TRANSPORT` not `nccl`.

    Every rank of an NCCL group makes the same collective call here whatever its inputs or
    environment (the first call per group gathers host names), and only then raises ValueError on a
    bad `RINGLSE_KV_TRANSPORT`; the ranks compare their answers in the agreement, since the
    environment may differ between them."""
    if comm.world == 1 or comm.backend != "nccl":
        return False
    if comm.same_host is None:
        # a gather of host-name digests (object collectives need numpy; Python's hash() differs between
        # processes) over the gloo group of the agreement, on the host and bounded like it: an NCCL
        # collective here would leave the survivors of a rank that died before the group's first ring
        # call waiting on the GPU until the watchdog (seen on 2xH100)
        digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        hosts = [torch.empty(1, dtype=torch.int64) for _ in range(comm.world)]
        work = dist.all_gather(hosts, mine, group=comm.host_group(), async_op=True)
        comm.wait([Pending(work, tuple(comm.others()), 0)], "agreement", comm.timeout())
        comm.same_host = all(int(h) == int(hosts[0]) for h in hosts)
    choice = os.environ.get("RINGLSE_KV_TRANSPORT", "auto")
    if choice not in ("auto", "nccl", "copy"):
        raise ValueError(f"RINGLSE_KV_TRANSPORT={choice!r}: choose auto, nccl or copy")
    usable = comm.same_host and _symm_mem() is not None
    if choice == "copy" and not usable:
        raise ValueError("RINGLSE_KV_TRANSPORT=copy: needs one host and a torch with symmetric memory")
    return usable and choice != "nccl"


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The high-priority stream of `device` for `role` (made once)."""
    key = (device.index, role)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=device, priority=-1)
    return _STREAMS[key]


def event_within(done: torch.cuda.Event, limit: datetime.timedelta, pause_cap: float = 1e-3) -> bool:
    """Poll `done` on the host until it has happened (True) or `limit` has passed (False), sleeping from
    50 us up to `pause_cap` seconds between polls."""
    deadline = time.monotonic() + limit.total_seconds()
    pause = 5e-5
    while not done.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, pause_cap)
    return True


class PulledKV:
    """This rank's packed K/V (a flat `KVPack` buffer: K `[b, n, hkv, d]`, then V `[b, n, hkv, d_v]`) in
    symmetric memory, and the other ranks' blocks pulled from theirs.

    The workspace holds two regions used by alternate calls. A call writes its region without
    waiting for anyone: the peers last read it two calls ago, and they finished those reads before
    they reached the previous call's barrier, which this rank's side stream has passed (the packing
    is queued behind it on that stream). So each call needs one GPU-side barrier (every buffer is
    published) instead of two.

    Args:
        comm: the ring's `RingComm`.
        k, v: this rank's K and V `[b, n, hkv, d]`; `kv` is their packed copy, written on the side
            stream (in the workspace when it is large enough already; growing it is collective, so
            that waits for `publish`).
        ready: a CUDA event recorded on the current stream once `k` and `v` are written and every
            earlier user of the pull destinations' memory is queued: the side stream waits for it.
    """

    def __init__(self, comm, k: torch.Tensor, v: torch.Tensor, ready: torch.cuda.Event):
        self.comm = comm
        self.pack = KVPack.of(k, v)
        self.dtype = k.dtype
        self.nbytes = self.pack.numel * k.element_size()
        self.workspaces = comm.pull_workspaces
        self.key = k.device.index
        self.stream = side_stream(k.device, "kv")
        self.arrived: dict[int, torch.cuda.Event] = {}
        self.handle = None
        self.stream.wait_event(ready)
        # k and v are read on the side stream: the current stream waits for a pull queued after this
        # (`wait`) before any later work of it can reuse their memory, and for everything at the end
        # (`finish`: a rank that reads nothing of the others pulls nothing)
        with torch.cuda.stream(self.stream):
            ws = self.workspaces.get(self.key)
            if ws is not None and ws[0].numel() >= 2 * self.nbytes:
                self.kv = self.pack.pack(k, v, out=self._region(ws))
            else:
                self.kv = self.pack.pack(k, v)

    def _region(self, ws) -> torch.Tensor:
        """Our region for this call: the first or second half of the workspace (fixed halves, so
        calls of different sizes never overlap a region a peer may still read)."""
        buf, handle, calls, _ = ws
        half = buf.numel() // 2
        self.handle, self.offset = handle, (calls % 2) * half // self.dtype.itemsize
        self.views = ws[3]
        return self._view(self.comm.rank)[0]

    def _view(self, rank: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Rank `rank`'s region of this call: the flat buffer `[pack.numel]` and its K and V; the views
        are kept per workspace (making one costs ~50 us of host time, and the first pull of a call
        waits for that)."""
        key = (rank, self.pack, self.dtype, self.offset)
        view = self.views.get(key)
        if view is None:
            if len(self.views) >= 256:  # shapes that keep changing: do not keep them all
                self.views.clear()
            flat = self.handle.get_buffer(rank, (self.pack.numel,), self.dtype, self.offset)
            view = self.views[key] = (flat, self.pack.views(flat))
        return view

    def publish(self, limit: datetime.timedelta) -> None:
        """Make our K/V readable by the group (after the ranks agreed on their inputs: growing the
        workspace is a collective). The GPU-side barrier waits at most `2 * limit + 10 s` for the
        peers: past it the barrier kernel traps, which kills this process (NCCL's watchdog finds its
        CUDA context broken) instead of a stream that waits for a dead peer forever and hangs every
        later device-wide synchronisation (NCCL's abort after a timed-out transfer included: seen on
        2xH100). The margin leaves the host's bounded wait for the barrier (`await_published`, under
        a call timeout) the time to raise its `RuntimeError` first; the trap is the last resort."""
        ws = self.workspaces.get(self.key)
        if ws is None or ws[0].numel() < 2 * self.nbytes:
            symm_mem = _symm_mem()
            if ws is not None:
                self.comm.retired_workspaces.append(ws)
            half = -(-self.nbytes // 256) * 256  # halves aligned for any dtype
            buf = symm_mem.empty(2 * half, dtype=torch.uint8, device=self.kv.device)
            handle = symm_mem.rendezvous(buf, self.comm.group_or_world())
            ws = self.workspaces[self.key] = [buf, handle, 0, {}]
        with torch.cuda.stream(self.stream):
            if self.handle is None:  # packed outside the workspace (first call, or it grew)
                region = self._region(ws)
                region.copy_(self.kv)
            # every rank's K/V is published
            self.handle.barrier(channel=0, timeout_ms=int((2 * limit.total_seconds() + 10) * 1000))
            self.published = torch.cuda.Event()
            self.published.record(self.stream)
        ws[2] += 1

    def await_published(self, limit: datetime.timedelta, phase: str) -> None:
        """With a call timeout (the host then waits for each transfer, as NCCL's `Work.wait(timeout)`
        does): wait on the host, at most `limit`, until every peer has reached the barrier, and raise
        the ring's `RuntimeError` for a peer that has not (dead or stalled) before any NCCL work is
        queued behind the stuck barrier. An NCCL wait that timed out there aborts its communicator,
        and the abort waited for the barrier's trap: the survivor died without raising (2xH100)."""
        if not event_within(self.published, limit):
            raise self.comm.fault(phase, 0, self.comm.others(), TimeoutError(
                f"the peers did not reach the copy-engine barrier within {limit}"))

    def finish(self) -> None:
        """The call is done with its pulls (or makes none: the ranks disagreed, or this rank reads no
        rows of the others): the current stream waits for the side stream, which may still be
        reading k and v."""
        current_stream().wait_stream(self.stream)

    def pull(self, s: int, dst: torch.Tensor, rows: tuple[int, int], after: torch.cuda.Event | None) -> None:
        """Copy rows `[k0, k1)` of rank (rank - s)'s K/V into `dst` (a flat buffer of the same pack),
        once `after` (the last reader of `dst`) has happened. Batches of more than one sequence pull
        whole blocks (their row ranges are not contiguous). No rows (a step this rank reads nothing
        at): no pull."""
        if rows[1] <= rows[0]:
            return
        src = (self.comm.rank - s) % self.comm.world
        remote = self._view(src)[1]
        k0, k1 = rows if self.pack.k[0] == 1 else (0, self.pack.k[1])
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            for mine, theirs in zip(self.pack.views(dst), remote):  # K, V: each a contiguous run of rows
                mine[:, k0:k1].copy_(theirs[:, k0:k1])
            done = torch.cuda.Event()
            done.record(self.stream)
        self.arrived[s] = done

    def wait(self, s: int) -> None:
        """Make the current stream wait for block s (if any rows of it were pulled)."""
        done = self.arrived.pop(s, None)
        if done is not None:
            current_stream().wait_event(done)
