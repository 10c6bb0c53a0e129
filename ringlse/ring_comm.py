"""Point-to-point plumbing of the ring, and the one small collective that makes ranks agree on their
inputs before any K/V moves (so a mismatch raises everywhere instead of hanging)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class RingComm:
    """Sends to rank+1 and receives from rank-1 within `group` (global ranks for point-to-point)."""

    def __init__(self, group: dist.ProcessGroup | None):
        if dist.is_available() and dist.is_initialized():
            self.group = group
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the given process group")
            to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
            self.next = to_global((self.rank + 1) % self.world)
            self.prev = to_global((self.rank - 1) % self.world)
            self.backend = dist.get_backend(group)
        else:
            if group is not None:
                raise ValueError("a process group was given but torch.distributed is not initialized")
            self.group, self.rank, self.world, self.next, self.prev, self.backend = None, 0, 1, 0, 0, None

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> list:
        """Post `send` -> rank+1 and `recv` <- rank-1; returns the works to `wait` on."""
        if self.world == 1:
            recv.copy_(send)
            return []
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: Sequence) -> None:
        for w in works:
            w.wait()

    def agree(self, meta: Sequence[int], error: str | None) -> None:
        """All ranks compare `meta` (ints describing their inputs) and their local `error`; if any rank
        has an error or any two disagree, every rank raises ValueError (the same decision everywhere)."""
        if self.world == 1:
            if error is not None:
                raise ValueError(error)
            return
        # NCCL only moves CUDA tensors; decide the device from the group, not from (maybe bad) inputs
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        row = torch.tensor([0 if error is None else 1, *meta], dtype=torch.int64, device=device)
        rows = [torch.empty_like(row) for _ in range(self.world)]
        dist.all_gather(rows, row, group=self.group)
        table = torch.stack(rows).cpu()
        if error is not None:
            raise ValueError(f"rank {self.rank}: {error}")
        bad = [r for r in range(self.world) if table[r, 0] != 0]
        if bad:
            raise ValueError(f"rank {self.rank}: ranks {bad} reported invalid input (see their errors)")
        differs = [r for r in range(self.world) if not torch.equal(table[r, 1:], table[self.rank, 1:])]
        if differs:
            raise ValueError(
                f"rank {self.rank}: ranks disagree on shapes/dtype/options: mine {table[self.rank, 1:].tolist()}, "
                + ", ".join(f"rank {r} {table[r, 1:].tolist()}" for r in differs)
            )
