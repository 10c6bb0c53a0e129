"""Per-device host state of the softmax launchers: what the device is (SMs, L2 bulk prefetch) and the
scratch memory its launches reuse, kept per (device, stream, thread).

Why scratch is kept: an allocation per call costs host time (`torch.empty` of a 3-D buffer and its
`unbind`: ~6 us on the H200 host), a fill costs a launch, and host time is what small inputs pay for.
Kernels on one stream run in order, so a kernel never shares scratch with a kernel in flight. One per
thread too: two threads on one stream interleave their launches (a call's stats kernel and the kernel
that reads its partials could be split by another call's), and the word buffers' turns are host state.
Buffers replaced or dropped are freed to the caching allocator, which hands them out again on this
stream only after the kernels queued before on it.
"""

from __future__ import annotations

import functools
import threading

import torch

from ringlse.kernels.host import cdiv
from ringlse.kernels.launch import current_raw_stream


@functools.cache
def num_sms(device: torch.device) -> int:
    """SMs of `device` (cached: reading the device properties costs more host time than a small
    softmax's kernels); 4 on CPU (the interpreter: any small number exercises the same paths)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.cache
def bulk_prefetch(device: torch.device) -> bool:
    """Whether kernels on `device` can ask for bulk prefetches into L2 (`prefetch_to_l2`: sm_90 on)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


class WordPool:
    """Two int64 word buffers, used by turns. A cooperative launch takes the buffer whose words are all
    -1 and resets the words that the launch before it (on the other buffer) left published; so no
    launch needs a fill of its own (a kernel, and on H200 ~2.5 us of GPU time between the L2 flush and
    the kernel in a `do_bench` call)."""

    def __init__(self, device: torch.device, n: int):
        self.bufs = torch.full((2, n), -1, dtype=torch.int64, device=device).unbind(0)
        self.dirty = [0, 0]  # words left published in each buffer
        self.turn = 0

    def launched(self, n: int) -> None:
        self.dirty[self.turn], self.dirty[1 - self.turn] = n, 0
        self.turn = 1 - self.turn


class Workspace:
    """Scratch of one (device, stream, thread): row counters (every kernel that counts on them leaves
    them at 0), float32 partial buffers, and the cooperative kernels' word buffers."""

    def __init__(self):
        self.counters: torch.Tensor | None = None
        self.partials: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self.words: WordPool | None = None


_WORKSPACES: dict[tuple[int, int, int], Workspace] = {}


def workspace(device: torch.device) -> Workspace | None:
    """The workspace of the current stream and thread on `device`; None under graph capture (a graph
    replays its launches with the buffers of its capture: they must be its own) and on CPU (the
    interpreter), where the scratch is fresh each call."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    key = (device.index, current_raw_stream(device.index), threading.get_ident())
    ws = _WORKSPACES.get(key)
    if ws is None:
        if len(_WORKSPACES) >= 64:  # (threads come and go; their ids are reused)
            _WORKSPACES.clear()
        ws = _WORKSPACES[key] = Workspace()
    return ws


def row_counters(ws: Workspace | None, device: torch.device, R: int) -> torch.Tensor:
    """At least `R` int32 counters that are 0 now; the kernel that uses them leaves them 0 again."""
    if ws is None:
        return torch.zeros(R, dtype=torch.int32, device=device)
    if ws.counters is None or ws.counters.numel() < R:
        ws.counters = torch.zeros(max(R, 1024), dtype=torch.int32, device=device)
    return ws.counters


def partials(ws: Workspace | None, device: torch.device, n: int, R: int, K: int) -> tuple[torch.Tensor, ...]:
    """`n` float32 `[R, K]` buffers (contents undefined) for a call's kernels to pass partial results."""
    if ws is None:
        return torch.empty((n, R, K), dtype=torch.float32, device=device).unbind(0)
    bufs = ws.partials.get((n, R, K))
    if bufs is None:
        if len(ws.partials) >= 16:
            ws.partials.clear()
        bufs = ws.partials[(n, R, K)] = torch.empty((n, R, K), dtype=torch.float32, device=device).unbind(0)
    return bufs


def coop_words(ws: Workspace | None, device: torch.device, n: int
               ) -> tuple[torch.Tensor, torch.Tensor, int, WordPool | None]:
    """(words, other, n_other, pool) for a cooperative launch of `n` words: `words` all -1, `other`
    with its first `n_other` words for the launch to reset, and the pool to tell once launched (None:
    nothing to tell; fresh words where there is no workspace)."""
    if ws is None:
        words = torch.full((n,), -1, dtype=torch.int64, device=device)
        return words, words, 0, None
    pool = ws.words
    if pool is None or pool.bufs[0].numel() < n:
        pool = ws.words = WordPool(device, max(cdiv(n, 64) * 64, 4096))  # (16-byte aligned halves)
    return pool.bufs[pool.turn], pool.bufs[1 - pool.turn], pool.dirty[1 - pool.turn], pool
