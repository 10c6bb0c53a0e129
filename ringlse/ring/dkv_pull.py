"""The backward's float32 dk/dv messages pulled home by copy engines, for rings within one host.

The `triton` ring's dk/dv messages are float32 (what keeps its error flat in W), twice the bytes of
the K/V they answer. Sent by NCCL, their kernels ran 8-10 ms per call beside the dk/dv kernel that
holds every SM, against 2.5-4 ms for the cuDNN ring's bf16 ones, and the compute stream idled 3-6 ms
waiting for them (4xH100, 32K). Copy engines need no SM: a rank builds each
message in a slot of a buffer in PyTorch's symmetric memory (mapped into every rank of the group by
CUDA IPC) and its owner copies it home from there with `cudaMemcpyAsync`, as `ringlse.ring.pull`
does for K/V.

Synchronisation, per slot, by counters in the symmetric memory's signal pads (one per pair of ranks
and channel), written and awaited by CUDA stream memory operations (`cuStreamWriteValue32`,
`cuStreamWaitValue32`: no kernel, no SM): once a message is built, the sender's side stream writes
the message's number into its owner's "ready" counter; the owner's receive stream waits for it,
copies, and writes the number into the sender's "read" counter; the sender's compute stream waits
for that (on the side stream) before it builds another message in the slot. Two slots, used by
alternate pieces, so a rank builds one piece while the last one travels. (The symmetric memory's own
`wait_signal` spins in a kernel: a kernel module loaded lazily meanwhile waited for it, and the
release below could not run; seen on 4xH100.)

Faults: at the end of the call (`finish`) the host waits for every message and slot at most `limit`
(the group's timeout where the call gave none) and raises the ring's `RuntimeError`, naming the step
and the peer; a rank only ever waits on its own pad, so before raising it sets the counters its
streams wait for itself (`release`) and nothing is left waiting for a peer that is gone. One gap:
CUDA's lazy module loading may synchronise the context, so a kernel this process launches for the
first time while a wait is pending on a dead peer blocks the host there (`CUDA_MODULE_LOADING=EAGER`
closes it); the fault tests run a good call first.

Used for pieces of keys (`ringlse.ring.backward.DKV_PIECES`, W >= 3) of ops that accumulate dk/dv
in float32 (the `InPlace` accumulation, `ringlse.blocks.accumulate`), under the same switch as the
K/V pulls (`ringlse.ring.dkv_return.CopyEngineReturn`); a piece whose keys do not fit a slot (masked
calls kept whole) travels by NCCL: both ends decide it from the same plan.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import functools

import torch

from ringlse.kv_pack import KVPack
from ringlse.ring.comm import current_stream
from ringlse.ring.pull import _symm_mem, event_within, side_stream

# channels of the message workspace's signal pads: "ready" and "read" per slot
_READY, _READ = 0, 2
SLOTS = 2
_RELEASED = 0xFFFFFFFF  # a counter past any message number (the waits are "greater or equal")

@functools.cache
def _memops() -> tuple:
    """The driver's `cuStreamWriteValue32` and `cuStreamWaitValue32` (through ctypes: torch exposes
    neither without a kernel)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fns = []
    for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns.append(fn)
    return tuple(fns)


def _memop(which: int, stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Queue on `stream` a write of `value` to `address` (which 0), or a wait until it holds at least
    `value` (which 1; flags 0 = greater or equal)."""
    err = _memops()[which](ctypes.c_void_p(stream.cuda_stream), address, value, 0)
    if err != 0:
        raise RuntimeError(f"ring_attention: CUDA stream memory operation failed (CUresult {err})")


@dataclasses.dataclass
class _Workspace:
    """A device's message slots in symmetric memory, kept on the group's `RingComm` across calls."""

    buf: torch.Tensor  # SLOTS slots of `slot_bytes`
    handle: object  # its symmetric-memory handle (the peers' slots and signal pads)
    slot_bytes: int
    views: dict = dataclasses.field(default_factory=dict)  # (rank, slot, pack, dtype) -> flat tensor
    owner: list = dataclasses.field(default_factory=lambda: [None] * SLOTS)  # each slot's last message went to
    pads: dict = dataclasses.field(default_factory=dict)  # rank -> its signal pad's address
    counts: dict = dataclasses.field(default_factory=dict)  # ("to" | "from", peer, channel) -> last number


class PulledMessages:
    """One backward call's dk/dv messages in this rank's slots, and the ones it pulls home.

    The workspace (two slots of `slot_rows` keys, each a flat float32 `KVPack` buffer: dk `[b, rows, hkv,
    d]`, then dv `[b, rows, hkv, d_v]`) lives on the group's `RingComm` (`message_workspaces`: device ->
    `_Workspace`) across calls; growing it is collective, and every rank asks for the same size (from the
    agreed shapes), so they grow together.

    Args:
        comm: the ring's `RingComm`.
        pack: the shapes of this rank's K and V (`[b, n, hkv, d]`, `[b, n, hkv, d_v]`).
        device: where they are.
        slot_rows: keys per slot.
        dtype: the messages' dtype (float32).
        limit: how long the host waits for one message or slot (None: the group's timeout).
    """

    def __init__(self, comm, pack: KVPack, device: torch.device, slot_rows: int, dtype: torch.dtype,
                 limit: datetime.timedelta | None):
        self.comm, self.dtype, self.pack = comm, dtype, pack
        self.slot_rows = slot_rows
        self.send_stream, self.recv_stream = side_stream(device, "dkv-send"), side_stream(device, "dkv-recv")
        self.limit = limit or comm.timeout()
        slot_bytes = -(-pack.rows(slot_rows).numel * dtype.itemsize // 256) * 256
        ws = comm.message_workspaces.get(device.index)
        if ws is None or ws.slot_bytes < slot_bytes:
            if ws is not None:
                comm.retired_workspaces.append(ws)
            symm_mem = _symm_mem()
            buf = symm_mem.empty(SLOTS * slot_bytes, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(buf, comm.group_or_world())
            ws = comm.message_workspaces[device.index] = _Workspace(buf, handle, slot_bytes)
        self.ws = ws
        self.waits: list[tuple[int, int]] = []  # (src, channel) of the counters this call waits on
        self.pending: list[tuple[torch.cuda.Event, int, int, str]] = []  # what `finish` waits for

    def fits(self, rows: int) -> bool:
        """Whether a message of `rows` keys fits a slot."""
        return rows <= self.slot_rows

    def _view(self, rank: int, slot: int, rows: int) -> torch.Tensor:
        """Slot `slot` of rank `rank`'s workspace as a flat buffer of a message of `rows` keys (`pack.rows`;
        views kept: making one costs ~50 us of host time)."""
        ws = self.ws
        pack = self.pack.rows(rows)
        key = (rank, slot, pack, self.dtype)
        view = ws.views.get(key)
        if view is None:
            if len(ws.views) >= 256:
                ws.views.clear()
            view = ws.views[key] = ws.handle.get_buffer(rank, (pack.numel,), self.dtype,
                                                        slot * ws.slot_bytes // self.dtype.itemsize)
        return view

    def _address(self, rank: int, channel: int, src: int) -> int:
        """Where the counter of `channel` from group rank `src` lies in group rank `rank`'s signal pad."""
        pads = self.ws.pads
        if rank not in pads:
            pads[rank] = self.ws.handle.get_signal_pad(rank, (4 * self.comm.world,), torch.int32).data_ptr()
        return pads[rank] + 4 * (channel * self.comm.world + src)

    def _signal(self, stream: torch.cuda.Stream, dst: int, channel: int) -> None:
        """Queue on `stream` the next number of our `channel` counter in rank `dst`'s pad."""
        key = ("to", dst, channel)
        n = self.ws.counts[key] = self.ws.counts.get(key, 0) + 1
        _memop(0, stream, self._address(dst, channel, self.comm.rank), n)

    def _await(self, stream: torch.cuda.Stream, src: int, channel: int) -> None:
        """Queue on `stream` a wait for the next number of rank `src`'s `channel` counter in our pad."""
        key = ("from", src, channel)
        n = self.ws.counts[key] = self.ws.counts.get(key, 0) + 1
        self.waits.append((src, channel))
        _memop(1, stream, self._address(self.comm.rank, channel, src), n)

    def message(self, piece: int, rows: int, step: int) -> torch.Tensor:
        """A zeroed flat message of `rows` keys (`KVPack.rows`) in piece `piece`'s slot, for the current
        stream to add dk/dv into, once the owner of the slot's last message has read it (step `step`, for a
        fault)."""
        slot = piece % SLOTS
        last_owner = self.ws.owner[slot]
        if last_owner is not None:
            self._await(self.send_stream, last_owner, _READ + slot)
            free = torch.cuda.Event()
            free.record(self.send_stream)
            self.pending.append((free, step, last_owner, "it did not read our last dk/dv message"))
            current_stream().wait_event(free)
            self.ws.owner[slot] = None
        msg = self._view(self.comm.rank, slot, rows)
        msg.zero_()
        return msg

    def send(self, piece: int, dst: int) -> None:
        """Piece `piece`'s message (queued on the current stream) goes to group rank `dst`, which pulls it."""
        slot = piece % SLOTS
        self.send_stream.wait_stream(current_stream())
        self._signal(self.send_stream, dst, _READY + slot)
        self.ws.owner[slot] = dst

    def receive(self, piece: int, src: int, rows: int, step: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Pull group rank `src`'s message of piece `piece` (`rows` keys, step `step`) into a new flat buffer
        once it is ready; returns the buffer and the event of its arrival (the current stream waits for it
        before reading the buffer)."""
        slot = piece % SLOTS
        reader = current_stream()
        self._await(self.recv_stream, src, _READY + slot)
        with torch.cuda.stream(self.recv_stream):
            # allocated on the pull's own stream, which so never waits for our compute stream: waiting
            # for it held the sender's slot until our queued kernels were done, and the sender with it
            buf = self.pack.rows(rows).empty(self.dtype, self.ws.buf.device)
            buf.record_stream(reader)
            buf.copy_(self._view(src, slot, rows))
            arrived = torch.cuda.Event()
            arrived.record(self.recv_stream)
        self._signal(self.recv_stream, src, _READ + slot)
        self.pending.append((arrived, step, src, "its dk/dv message did not arrive"))
        return buf, arrived

    def release(self) -> None:
        """After a failed call: set every counter this call's streams may still wait for past any message
        number, so nothing waits on for a peer that is gone (the group is marked failed: nothing reads
        these counters again)."""
        stream = torch.cuda.Stream(device=self.ws.buf.device)
        for src, channel in self.waits:
            _memop(0, stream, self._address(self.comm.rank, channel, src), _RELEASED)
        stream.synchronize()

    def finish(self) -> None:
        """At the end of the call: wait on the host, at most `limit` each, until every message came home and
        every slot was read (the host waits nowhere else: waiting for each piece left the GPU idle, 22.4-24.7
        against 18.8-19.0 ms per 32K call on 4xH100). Past it, release this call's waits and raise the ring's
        `RuntimeError` naming the step and the peer. Queued after the call's last block, which the GPU is
        still computing, so this costs the GPU nothing."""
        for done, step, peer, what in self.pending:
            if not event_within(done, self.limit, pause_cap=5e-5):
                self.release()
                raise self.comm.fault("backward", step, [peer], TimeoutError(f"{what} within {self.limit}"))
        self.pending.clear()
