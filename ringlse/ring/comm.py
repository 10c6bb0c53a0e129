"""Point-to-point plumbing of the ring (`RingComm`, one per live process group) and the NCCL settings
its transfers run best with.

Faults: every wait of the ring (the agreement, each K/V transfer, each dk/dv message) is bounded and
names what it waited for. A failure or timeout of one becomes `RuntimeError("ring_attention: {phase}
step {s}: waiting for rank {peer} (global {g}): {original}")`, with the transport's exception as its
`__cause__`, and marks the comm failed: messages of the failed call may still be in flight and gloo
matches messages by peer and tag only, so a later call on the same group could take one for its own
(a silently wrong answer); every later ring call on that group raises at once instead.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ringlse.ring.agreement import Agreement, Describe, post_agreement

# NCCL picks how many channels carry a point-to-point message from its size in chunks: with the
# default 512 KiB NVLink chunk, a 64-128 MiB K/V block moved at ~110 GiB/s on 4xH200 (NCCL 2.28),
# with 128 KiB chunks at ~300 GiB/s.
# High-priority NCCL streams: a transfer queued next to an attention kernel that fills every SM
# otherwise waits for that kernel's blocks to drain before its own get scheduled (on 4xH200 a
# 128 MiB K/V transfer took 1.2 ms beside the cuDNN forward instead of 0.45 ms).
NCCL_RING_ENV = {"NCCL_P2P_NVL_CHUNKSIZE": str(128 * 1024), "TORCH_NCCL_HIGH_PRIORITY": "1"}


def tune_nccl_env() -> dict[str, str]:
    """Set the NCCL variables the ring's transfers run best with, unless the user set them already.

    Call it before `init_process_group` (NCCL reads them when it creates its communicator), and
    pass `pg_options=ringlse.nccl_options(timeout)` there too. Returns the values in effect.
    """
    for key, value in NCCL_RING_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in NCCL_RING_ENV}


def nccl_options(timeout: datetime.timedelta | None = None):
    """`ProcessGroupNCCL.Options` with high-priority streams, for `init_process_group(pg_options=...)`
    (torch's default options switch them off whatever the environment says).

    Args:
        timeout: the `timeout=` given to `init_process_group` (None: torch's NCCL default). The options
            carry it too, since torch warns on every rank when the two differ.
    """
    if not dist.is_nccl_available():
        raise RuntimeError("nccl_options: this torch build has no NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = os.environ.get("TORCH_NCCL_HIGH_PRIORITY", "1") != "0"
    options._timeout = timeout or dist.constants.default_pg_nccl_timeout or dist.constants.default_pg_timeout
    return options


class Pending(NamedTuple):
    """A posted transfer: its work, the group ranks at the other end (one; more where a backend
    coalesces a batch into one work, as NCCL does), and the ring step it serves."""

    work: dist.Work
    peers: tuple[int, ...]
    step: int


# One RingComm per live process group, held weakly: a comm (and the gloo group and copy-engine
# workspaces it made) goes when its group does. A strong cache kept destroyed groups alive until
# interpreter exit, where their late destruction aborted one rank in about a third of torchrun runs.
_COMMS: weakref.WeakKeyDictionary[dist.ProcessGroup, RingComm] = weakref.WeakKeyDictionary()


class RingComm:
    """Sends to rank+1 and receives from rank-1 within `group` (global ranks for point-to-point),
    and compares the ranks' inputs before any K/V moves (`post_agreement`)."""

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None) -> RingComm:
        """The `RingComm` of `group`, made once per live group object (its queries of the process
        group and the agreement's gloo group cost host time on every call otherwise)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(group)  # a single rank: nothing worth keeping
        key = dist.group.WORLD if group is None else group  # a new object after the default group is re-created
        comm = _COMMS.get(key)
        if comm is None:
            comm = _COMMS[key] = cls(group)
        return comm

    def __init__(self, group: dist.ProcessGroup | None):
        # weakly: the cache of comms must not keep a destroyed group alive (see `_COMMS`)
        self._group_ref = None if group is None else weakref.ref(group)
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the given process group")
            to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
            self.global_ranks = [to_global(r) for r in range(self.world)]
            self.backend = dist.get_backend(group)
        else:
            if group is not None:
                raise ValueError("a process group was given but torch.distributed is not initialized")
            self.rank, self.world, self.global_ranks, self.backend = 0, 1, [0], None
        self.next = self.global_ranks[(self.rank + 1) % self.world]
        self.prev = self.global_ranks[(self.rank - 1) % self.world]
        self._stream: torch.cuda.Stream | None = None
        # a gloo group of the same ranks, made for a group of another backend on its first agreement;
        # a gloo group is its own (read through `group`, never kept here: a strong reference would
        # keep it alive, see `_COMMS`)
        self._gloo_twin: dist.ProcessGroup | None = None
        # what the copy-engine transport keeps per device (`ringlse.ring.pull`): freed with the comm,
        # that is with its group
        self.same_host: bool | None = None
        self.pull_workspaces: dict[int, list] = {}
        self.message_workspaces: dict[int, object] = {}  # the backward's dk/dv slots (`ringlse.ring.dkv_pull`)
        self.retired_workspaces: list = []
        # why an earlier call on this group failed (None: none did); see the module docstring
        self.failed: str | None = None
        self._timeout: datetime.timedelta | None = None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None: the default group)."""
        if self._group_ref is None:
            return None
        group = self._group_ref()
        if group is None:
            raise RuntimeError("ring_attention: the process group of this call was destroyed")
        return group

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0,
                 ready: torch.cuda.Event | None = None, step: int = 0, phase: str = "transfer") -> list[Pending]:
        """Post `send` -> rank+1 and `recv` <- rank-1 for ring step `step` of `phase` (forward,
        backward: what a failure to post names); returns the transfers to `wait` on.

        NCCL starts a transfer once everything queued so far on the current stream is done. With
        `ready` (an event recorded when `send` was written) it is posted from a side stream and waits
        for that event only, so it can overlap kernels queued earlier on the current stream."""
        if self.world == 1:
            recv.copy_(send)
            return []
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        peers = [(self.rank + 1) % self.world, (self.rank - 1) % self.world]
        return self._pending(self._post(ops, ready, phase, step, peers), peers, step)

    def send_recv(self, sends: Sequence[torch.Tensor], dst: int, recvs: Sequence[torch.Tensor], src: int,
                  tag: int = 0, step: int = 0, ready: torch.cuda.Event | None = None,
                  phase: str = "transfer") -> list[Pending]:
        """Post `sends` -> group rank `dst` and `recvs` <- group rank `src` (in order, as one batch) for
        ring step `step` of `phase`; returns the transfers to `wait` on. Every pair of ranks must post matching
        batches in the same order (NCCL matches point-to-point messages by order, not by tag).
        `ready`: as in `exchange`, an event the batch waits for instead of the whole current stream."""
        ops = [dist.P2POp(dist.isend, t, self.global_ranks[dst], self.group, tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_ranks[src], self.group, tag) for t in recvs]
        if not ops:
            return []
        peers = [dst] * len(sends) + [src] * len(recvs)
        return self._pending(self._post(ops, ready, phase, step, peers), peers, step)

    def _post(self, ops: list[dist.P2POp], ready: torch.cuda.Event | None, phase: str, step: int,
              peers: list[int]) -> list:
        """Post a batch: on the current stream, or with `ready` (CUDA tensors) from the side stream once
        `ready` has happened, so that it can overlap kernels queued earlier on the current stream. A batch
        that cannot be posted is a fault of step `step` (`fault`): gloo raises at once where a peer has
        gone, before any wait."""
        try:
            if ready is None or ops[0].tensor.device.type != "cuda":
                return dist.batch_isend_irecv(ops)
            stream = self._side_stream()
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                return dist.batch_isend_irecv(ops)
        except Exception as e:  # noqa: BLE001 - any failure of a transfer is a fault of the ring
            raise self.fault(phase, step, sorted(set(peers)), e) from e

    @staticmethod
    def _pending(works: list, peers: list[int], step: int) -> list[Pending]:
        if len(works) != len(peers):  # a backend that coalesces the batch: each work waits for every peer
            return [Pending(w, tuple(sorted(set(peers))), step) for w in works]
        return [Pending(w, (p,), step) for w, p in zip(works, peers)]

    def wait(self, pending: Sequence[Pending], phase: str = "transfer", limit: datetime.timedelta | None = None) -> None:
        """Wait for the transfers `pending` of `phase` (forward, backward), all within `limit` (None:
        the backend's own bound, for NCCL its watchdog; the host does not block). A failure or a
        timeout raises `RuntimeError` naming the step and the peer (`fault`)."""
        deadline = None if limit is None else time.monotonic() + limit.total_seconds()
        for p in pending:
            try:
                if deadline is None:
                    done = p.work.wait()
                else:
                    done = p.work.wait(_at_least_1ms(deadline - time.monotonic()))
                if done is False:
                    raise TimeoutError(f"not done within {limit}")
            except Exception as e:  # noqa: BLE001 - any failure of a transfer is a fault of the ring
                raise self.fault(phase, p.step, p.peers, e) from e

    def others(self) -> list[int]:
        """The group ranks other than this one."""
        return [r for r in range(self.world) if r != self.rank]

    def fault(self, phase: str, step: int, peers: Sequence[int], original: BaseException) -> RuntimeError:
        """The `RuntimeError` of a failed or timed-out wait of ring step `step` in `phase` for the group
        ranks `peers`; marks this comm failed (see the module docstring)."""
        peers = list(peers) or self.others()
        who = (f"rank {peers[0]} (global {self.global_ranks[peers[0]]})" if len(peers) == 1 else
               f"ranks {', '.join(map(str, peers))} (global {', '.join(str(self.global_ranks[p]) for p in peers)})")
        message = f"ring_attention: {phase} step {step}: waiting for {who}: {original}"
        if self.failed is None:
            self.failed = message
        return RuntimeError(message)

    @contextlib.contextmanager
    def guard(self, phase: str) -> Iterator[None]:
        """Mark this comm failed if anything escapes the block (an exception of a block op, an
        interrupt): transfers of the call may be posted and never waited for."""
        try:
            yield
        except BaseException as e:
            if self.failed is None and self.world > 1:
                self.failed = f"ring_attention: {phase}: {type(e).__name__}: {e}"
            raise

    def check_usable(self) -> None:
        """Raise `RuntimeError` if an earlier ring call on this group failed."""
        if self.failed is not None:
            raise RuntimeError(
                f"ring_attention: an earlier call on this process group failed ({self.failed}); its messages "
                "may still be in flight, so the group can no longer carry a ring: destroy it and make a new one")

    def transfer_limit(self, timeout: datetime.timedelta | None) -> datetime.timedelta | None:
        """How long one K/V or dk/dv wait may take: `timeout` where the caller gave one; else the
        group's timeout on gloo (the host waits anyway) and None on NCCL (the watchdog enforces the
        group's timeout; a host wait with a timeout would block the host until the transfer is done)."""
        if timeout is not None:
            return timeout
        return self.timeout() if self.backend == "gloo" else None

    def post_agreement(self, meta: Sequence[int], error: str | None, timeout: datetime.timedelta | None = None,
                       describe: Describe | None = None) -> Agreement:
        """Start comparing `meta` (ints describing this rank's inputs) and its local `error` across
        the ranks (`ringlse.ring.agreement`); every rank calls it once per ring call. Its waits last at
        most `timeout` (None: the group's)."""
        limit = self.timeout() if timeout is None else timeout
        return post_agreement(self.rank, self.world, self.host_group(), meta, error, limit=limit,
                              fault=lambda step, peers, e: self.fault("agreement", step, peers, e),
                              describe=describe)

    def timeout(self) -> datetime.timedelta:
        """The process group's timeout (torch's default where the group does not say)."""
        if self._timeout is None:
            device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
            try:
                self._timeout = self.group_or_world()._get_backend(device).options._timeout
            except (AttributeError, RuntimeError):
                self._timeout = dist.default_pg_timeout
        return self._timeout

    def group_or_world(self) -> dist.ProcessGroup:
        """The process group object (the default group for `group=None`)."""
        return self.group if self.group is not None else dist.group.WORLD

    def host_group(self) -> dist.ProcessGroup | None:
        """The gloo group that host-side exchanges (the agreement, the host check of the copy-engine
        transport) run over: the group itself, or for another backend a gloo twin of the same ranks,
        made at the group's first ring call. Only the members take part in making it, and it waits as
        long as the group would. A member that died before that call never joins: every other one
        raises the agreement's `RuntimeError`, naming all the others (the store does not say who is
        missing). NCCL collectives are never used for these: a dead peer would leave them waiting
        on the GPU, where only the watchdog ends them."""
        if self.world > 1 and self.backend != "gloo" and self._gloo_twin is None:
            try:
                self._gloo_twin = dist.new_group(self.global_ranks, backend="gloo", timeout=self.timeout(),
                                                 use_local_synchronization=True)
            except Exception as e:  # noqa: BLE001 - a store timeout or a closed connection: a fault
                raise self.fault("agreement", 0, self.others(), e) from e
        return self.group if self._gloo_twin is None else self._gloo_twin


def current_stream() -> torch.cuda.Stream:
    """The current device's current stream: `torch.cuda.current_stream()` without the device lookup it
    makes with no device given (which asks whether CUDA is available, every call)."""
    return torch.cuda.current_stream(torch.cuda.current_device())


def record_event() -> torch.cuda.Event:
    """An event recorded now on the current stream: what a transfer posted from the side stream waits
    for instead of everything queued."""
    ev = torch.cuda.Event()
    ev.record(current_stream())
    return ev


def _at_least_1ms(seconds: float) -> datetime.timedelta:
    """A wait's timeout: `Work.wait(timedelta(0))` means no timeout at all, and gloo counts whole ms."""
    return datetime.timedelta(seconds=max(seconds, 0.001))
