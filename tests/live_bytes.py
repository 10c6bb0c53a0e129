"""Peak bytes of tensor storage allocated inside a region and alive at once, on any device (CPU
included, where torch keeps no allocator statistics).

A `TorchDispatchMode` sees every op that reaches the dispatcher, autograd's backward included (the
engine runs CPU backward on the calling thread and carries the mode to its own threads). Each op's
output storages that are not among its inputs' storages were made by the op: their bytes count from
then until the storage is freed, which `weakref.finalize` on the storage reports (PyTorch keeps one
Python object per storage while anything, a view or a tensor saved by autograd, still holds it, so
the finalizer runs when the memory goes back, not when our handle does; tests/test_ring_memory.py
checks this on toy cases). A storage counts once, however many views of it come out of later ops.

ringlse's own ops (`ringlse::attend`, `ringlse::ring` and their backwards) would reach the mode as one
op each, with the mode off while they run: their Python implementations are run here instead, under
the mode, so the ops inside them count too.

Not seen: memory that kernels or communication backends allocate internally without returning it
as a tensor (scratch inside one op: the same in any two regions that run the same kernels), and the
growth of a storage resized in place (`out=` arguments; no code measured here uses them).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as m: ...`: then `m.peak` is the most bytes of storage made inside the region
    that were alive at one time, `m.live` what is still alive (the region's results). Tensors that
    existed before the region, and views of them, count nothing."""

    def __init__(self) -> None:
        super().__init__()
        from ringlse import ops

        lib = torch.ops.ringlse
        self._impls = {lib.attend.default: ops._attend_impl, lib.attend_backward.default: ops._attend_backward_impl,
                       lib.ring.default: ops._ring_impl, lib.ring_backward.default: ops._ring_backward_impl}
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # data_ptr -> nbytes of the storages counted and still alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = self._impls.get(func)
        if impl is None:
            out = func(*args, **(kwargs or {}))
        else:
            with self:  # the op's own ops, seen one by one
                out = impl(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in inputs or ptr in self._sizes:
            return
        self._sizes[ptr] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, ptr)

    def _freed(self, ptr: int) -> None:
        self.live -= self._sizes.pop(ptr, 0)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (a second phase of one region)."""
        self.peak = self.live
