"""Point-to-point plumbing of the ring, and the agreement that makes ranks compare their inputs before
any K/V moves (so a mismatch raises everywhere instead of hanging): a table in host shared memory, a
gloo gather, or an NCCL gather (`RingComm.post_agreement`)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ringlse.shared_table import SharedTable

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


# One RingComm per live process group, held weakly: a comm (and the gloo group and shared table it
# made) goes when its group does. A strong cache kept destroyed groups alive until interpreter exit,
# where their late destruction aborted one rank in about a third of torchrun runs.
_COMMS: weakref.WeakKeyDictionary[dist.ProcessGroup, RingComm] = weakref.WeakKeyDictionary()
_AGREEMENT_COLS = 32  # integers per rank in a shared agreement table (a ring call posts 15)


class Agreement:
    """The pending comparison of the ranks' inputs (`RingComm.post_agreement`): `ready()` says
    whether every rank's row is in (without waiting); calling it waits for them and raises
    ValueError on every rank when any rank's inputs are bad or two ranks disagree."""

    def __init__(self, ready: Callable[[], bool], check: Callable[[], None]):
        self.ready = ready
        self._check = check

    def __call__(self) -> None:
        self._check()


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
        # "shared", "host" or "device" (see `post_agreement`); None: decided on the first call
        self.agreement: str | None = None
        # a gloo group of the same ranks, made for an NCCL group; a gloo group is its own (read
        # through `group`, never kept here: a strong reference would keep it alive, see `_COMMS`)
        self._gloo_twin: dist.ProcessGroup | None = None
        self._table: SharedTable | None = None
        self._calls = 0  # agreements posted through the shared table (numbered alike on every rank)
        self._decided = False

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
        ranks; returns the pending `Agreement`: calling it raises ValueError on every rank if any
        rank has an error or any two disagree (the same decision everywhere), and returns quietly
        otherwise; `ready()` says whether that would return without waiting.

        Where the comparison happens is decided collectively on the group's first call
        (`agreement`): `"shared"`, a table in host shared memory (every rank on one x86-64 host: no
        round trip, `ringlse.shared_table`); `"host"`, a gloo gather (the group itself, or for NCCL a
        gloo group of the same ranks); `"device"`, an NCCL gather on a side stream (NCCL without
        gloo), which waits for that gather alone, not for kernels queued on the current stream.
        None of them waits for kernels, so a caller can queue local work before checking."""
        if self.world == 1:
            def check_alone() -> None:
                if error is not None:
                    raise ValueError(error)
            return Agreement(lambda: True, check_alone)
        row = [0 if error is None else 1, *meta]
        mode = self._agreement_mode()
        if mode == "shared":
            self._calls += 1
            seq, table = self._calls, self._table
            table.post(seq, row)
            return Agreement(lambda: table.arrived(seq), lambda: self._decide(table.gather(seq), error))
        if mode == "host":
            table_cpu = torch.empty((self.world, len(row)), dtype=torch.int64)
            work = dist.all_gather(list(table_cpu.unbind(0)), torch.tensor(row, dtype=torch.int64),
                                   group=self._host_group(), async_op=True)

            def check_host() -> None:
                work.wait()
                self._decide(table_cpu.tolist(), error)
            return Agreement(work.is_completed, check_host)
        # NCCL only moves CUDA tensors; decide the device from the group, not from (maybe bad) inputs
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            row_gpu = torch.tensor(row, dtype=torch.int64).pin_memory().to("cuda", non_blocking=True)
            table = torch.empty((self.world, len(row)), dtype=torch.int64, device="cuda")
            dist.all_gather_into_tensor(table, row_gpu, group=self.group)
            table_cpu = torch.empty(table.shape, dtype=torch.int64, pin_memory=True)
            table_cpu.copy_(table, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        in_flight = (row_gpu, table)  # alive until the copy is done

        def check_nccl() -> None:
            done.synchronize()
            assert in_flight
            self._decide(table_cpu.tolist(), error)
        return Agreement(done.query, check_nccl)

    def _agreement_mode(self) -> str:
        """`self.agreement`, decided on the first call, collectively (every rank of the group makes
        its first ring call together): the best available, or the one set before that call (tests
        force each); "shared" falls back to "host" where the ranks cannot share a table."""
        if self._decided:
            return self.agreement
        wanted = self.agreement
        if wanted == "device" or (self.backend != "gloo" and not dist.is_gloo_available()):
            self.agreement = "device"
        else:
            # only the members take part in making the gloo group and the table
            if self.backend != "gloo":
                self._gloo_twin = dist.new_group(self.global_ranks, backend="gloo", use_local_synchronization=True)
            if wanted in (None, "shared"):
                self._table = SharedTable.create(self._host_group(), self.rank, self.global_ranks[0], _AGREEMENT_COLS)
            self.agreement = "shared" if self._table is not None else "host"
        self._decided = True
        return self.agreement

    def _host_group(self) -> dist.ProcessGroup | None:
        """The gloo group the host-side agreement runs over."""
        return self.group if self._gloo_twin is None else self._gloo_twin

    def _decide(self, rows: list[list[int]], error: str | None) -> None:
        if error is not None:
            raise ValueError(f"rank {self.rank}: {error}")
        bad = [r for r in range(self.world) if rows[r][0] != 0]
        if bad:
            raise ValueError(f"rank {self.rank}: ranks {bad} reported invalid input (see their errors)")
        mine = rows[self.rank][1:]
        differs = [r for r in range(self.world) if rows[r][1:] != mine]
        if differs:
            raise ValueError(
                f"rank {self.rank}: ranks disagree on shapes/dtype/options: mine {mine}, "
                + ", ".join(f"rank {r} {rows[r][1:]}" for r in differs)
            )
