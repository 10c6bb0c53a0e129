"""How a head group of U ranks splits one ring part (CONVENTIONS.md §5.1): its positions into U
contiguous pieces (`head_piece`, `gather_head_pieces`, behind `shard`/`unshard`), and its heads into U
contiguous blocks after the all-to-all (`HeadSplit`). Pure functions of shapes and group sizes, so every
rank computes the same; nothing here moves attention data except `gather_head_pieces`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def head_rank_and_size(head_group: dist.ProcessGroup) -> tuple[int, int]:
    """`(rank in head_group, its size)`; ValueError when this process is not a member."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a head group was given but torch.distributed is not initialized")
    rank = dist.get_rank(head_group)
    if rank < 0:
        raise ValueError("this process is not a member of the given head group")
    return rank, dist.get_world_size(head_group)


def check_piece(part: int, heads_ranks: int, seqlen: int | None = None) -> int:
    """Tokens per piece when a ring part of `part` tokens splits over `heads_ranks` ranks; ValueError
    naming the lengths otherwise (`seqlen`: the global length, for the message)."""
    if part % heads_ranks:
        whole = f"sequence length {seqlen}: " if seqlen is not None else ""
        raise ValueError(f"{whole}a ring part of {part} tokens does not split into U={heads_ranks} equal "
                         f"pieces over the head group")
    return part // heads_ranks


def head_piece(positions: torch.Tensor, head_group: dist.ProcessGroup | None, seqlen: int | None = None
               ) -> torch.Tensor:
    """The positions of this rank's piece of a ring part whose positions (in the order the ring part
    holds them) are `positions`: the `head_rank`-th of U contiguous pieces. Without a head group, all."""
    if head_group is None:
        return positions
    rank, size = head_rank_and_size(head_group)
    n = check_piece(positions.numel(), size, seqlen)
    return positions[rank * n:(rank + 1) * n]


def gather_head_pieces(x_local: torch.Tensor, dim: int, head_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ring part held by `head_group`: every rank's piece along `dim`, in head-group rank order (the
    inverse of `head_piece`). Without a head group, `x_local` itself."""
    if head_group is None:
        return x_local
    _, size = head_rank_and_size(head_group)
    if size == 1:
        return x_local
    parts = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(size)]
    dist.all_gather(parts, x_local.contiguous(), group=head_group)
    return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class HeadSplit:
    """How `nheads` query heads and `nheads_kv` K/V heads split over a head group of `size` ranks: rank u
    gets query heads `[u·h/U, (u+1)·h/U)` and the K/V heads `kv_heads[u·m:(u+1)·m]` (m = `kv_per_rank`),
    in an order that keeps the GQA rule (local query head t reads local K/V head `t // (h/U / m)`).

    Where `nheads_kv` divides over U these are K/V heads `[u·hkv/U, (u+1)·hkv/U)` (`kv_split_as_is`);
    otherwise each rank gets the fewest K/V heads, repeated across ranks, that keep that rule: one per
    rank where a rank's query heads share one (8/1, 8/2 over U = 4), else one per query head."""

    nheads: int
    nheads_kv: int
    size: int
    kv_per_rank: int
    kv_heads: tuple[int, ...]

    @property
    def heads_per_rank(self) -> int:
        return self.nheads // self.size

    @property
    def kv_split_as_is(self) -> bool:
        return self.kv_heads == tuple(range(self.nheads_kv))

    @classmethod
    def of(cls, nheads: int, nheads_kv: int, size: int) -> HeadSplit:
        """The split of `nheads` / `nheads_kv` heads over `size` ranks; ValueError when the query heads
        do not divide over them (GQA itself, `nheads % nheads_kv == 0`, is the caller's check)."""
        if nheads % size:
            raise ValueError(f"ring_attention: nheads ({nheads}) does not divide over the head group's U={size} "
                             "ranks (each rank attends h/U heads after the all-to-all)")
        hu, group = nheads // size, nheads // nheads_kv
        for m in (m for m in range(1, hu) if hu % m == 0):
            per = hu // m  # local query heads per local K/V head
            heads = [(u * hu + t * per) // group for u in range(size) for t in range(m)]
            if all((u * hu + t) // group == heads[u * m + t // per] for u in range(size) for t in range(hu)):
                return cls(nheads, nheads_kv, size, m, tuple(heads))
        return cls(nheads, nheads_kv, size, hu, tuple(h // group for h in range(nheads)))  # one per query head
