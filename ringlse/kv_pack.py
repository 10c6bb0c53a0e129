"""A K/V pair (or a dk/dv pair) in one flat buffer: K's elements, then V's, each in its own shape, so that
V may have a head dim of its own (CONVENTIONS.md §1: DeepSeek-style MLA) and a block still travels as one
message. With equal head dims the buffer holds exactly the bytes of `torch.stack([k, v])`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVPack:
    """The shapes of a packed pair: `k` `[b, n, hkv, d]` and `v` `[b, n, hkv, d_v]` (dk and dv likewise)."""

    k: tuple[int, ...]
    v: tuple[int, ...]

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> KVPack:
        """The pack of tensors `k` `[b, n, hkv, d]` and `v` `[b, n, hkv, d_v]`."""
        return cls(tuple(k.shape), tuple(v.shape))

    def rows(self, n: int) -> KVPack:
        """The same pair over `n` rows (a piece of keys)."""
        return KVPack((self.k[0], n, *self.k[2:]), (self.v[0], n, *self.v[2:]))

    @property
    def numel(self) -> int:
        """Elements of the flat buffer: K's and V's."""
        return math.prod(self.k) + math.prod(self.v)

    def empty(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new flat buffer `[numel]`."""
        return torch.empty(self.numel, dtype=dtype, device=device)

    def zeros(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new zeroed flat buffer `[numel]`."""
        return torch.zeros(self.numel, dtype=dtype, device=device)

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k, v)`: the flat buffer `buf` `[numel]` seen as the pair (contiguous views)."""
        nk = math.prod(self.k)
        return buf[:nk].view(self.k), buf[nk:self.numel].view(self.v)

    def pack(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`k` and `v` copied into `out` (a flat buffer `[numel]`; None: a new one), returned."""
        buf = self.empty(k.dtype, k.device) if out is None else out
        if self.k == self.v:  # one copy kernel for both, as the ring has always packed equal head dims
            torch.stack([k, v], out=buf[:self.numel].view(2, *self.k))
        else:
            for dst, src in zip(self.views(buf), (k, v)):
                dst.copy_(src)
        return buf

    def row_views(self, buf: torch.Tensor, rows: tuple[int, int]) -> list[torch.Tensor]:
        """Rows `[k0, k1)` of the pair in `buf` as contiguous views, K's then V's, one per sequence of the
        batch (point-to-point messages are contiguous; the rows of a batch of sequences are not)."""
        k0, k1 = rows
        if k1 <= k0:
            return []
        return [t[j, k0:k1] for t in self.views(buf) for j in range(t.shape[0])]
