"""Point-to-point plumbing of the ring (`RingComm`, one per live process group) and the NCCL settings
its transfers run best with."""

from __future__ import annotations

import datetime
import os
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringlse.ring.agree import Agreement, post_agreement

# NCCL picks how many channels carry a point-to-point message from its size in chunks: with the
# default 512 KiB NVLink chunk, a 64-128 MiB K/V block moved at ~110 GiB/s on 4xH200 (NCCL 2.28),
# with 128 KiB chunks at ~300 GiB/s (benchmarks/p2p_bandwidth.py, benchmarks/NOTES.md).
# High-priority NCCL streams: a transfer queued next to an attention kernel that fills every SM
# otherwise waits for that kernel's blocks to drain before its own get scheduled (on 4xH200 a
# 128 MiB K/V transfer took 1.2 ms beside the cuDNN forward instead of 0.45 ms).
NCCL_RING_ENV = {"NCCL_P2P_NVL_CHUNKSIZE": str(128 * 1024), "TORCH_NCCL_HIGH_PRIORITY": "1"}


def tune_nccl_env() -> dict[str, str]:
    """Set the NCCL variables the ring's transfers run best with, unless the user set them already.

    Call it before `init_process_group` (NCCL reads them when it creates its communicator), and
    pass `pg_options=ringlse.nccl_options()` there too. Returns the values in effect.
    """
    for key, value in NCCL_RING_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in NCCL_RING_ENV}


def nccl_options():
    """`ProcessGroupNCCL.Options` with high-priority streams, for `init_process_group(pg_options=...)`
    (torch's default options switch them off whatever the environment says)."""
    if not dist.is_nccl_available():
        raise RuntimeError("nccl_options: this torch build has no NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = os.environ.get("TORCH_NCCL_HIGH_PRIORITY", "1") != "0"
    return options


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
        self.retired_workspaces: list = []

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
                 ready: torch.cuda.Event | None = None) -> list:
        """Post `send` -> rank+1 and `recv` <- rank-1; returns the works to `wait` on.

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
        if ready is None or send.device.type != "cuda":
            return dist.batch_isend_irecv(ops)
        stream = self._side_stream()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            return dist.batch_isend_irecv(ops)

    def send_recv(self, sends: Sequence[torch.Tensor], dst: int, recvs: Sequence[torch.Tensor], src: int,
                  tag: int = 0) -> list:
        """Post `sends` -> group rank `dst` and `recvs` <- group rank `src` (in order, as one batch);
        returns the works to `wait` on. Every pair of ranks must post matching batches in the same
        order (NCCL matches point-to-point messages by order, not by tag)."""
        ops = [dist.P2POp(dist.isend, t, self.global_ranks[dst], self.group, tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_ranks[src], self.group, tag) for t in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def wait(works: Sequence) -> None:
        for w in works:
            w.wait()

    def post_agreement(self, meta: Sequence[int], error: str | None) -> Agreement:
        """Start comparing `meta` (ints describing this rank's inputs) and its local `error` across
        the ranks (`ringlse.ring.agree`); every rank calls it once per ring call."""
        if self.world > 1 and self.backend != "gloo" and self._gloo_twin is None:
            # only the members take part in making it; it waits as long as the group would
            self._gloo_twin = dist.new_group(self.global_ranks, backend="gloo", timeout=self.timeout(),
                                             use_local_synchronization=True)
        return post_agreement(self.rank, self.world, self._host_group(), meta, error)

    def timeout(self) -> datetime.timedelta:
        """The process group's timeout (torch's default where the group does not say)."""
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        try:
            return self.group_or_world()._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            return dist.default_pg_timeout

    def group_or_world(self) -> dist.ProcessGroup:
        """The process group object (the default group for `group=None`)."""
        return self.group if self.group is not None else dist.group.WORLD

    def _host_group(self) -> dist.ProcessGroup | None:
        """The gloo group the host-side agreement runs over."""
        return self.group if self._gloo_twin is None else self._gloo_twin
