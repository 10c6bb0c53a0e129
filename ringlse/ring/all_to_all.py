"""A differentiable all-to-all over a process group, with the ring's bounded waits and fault reports
(head parallelism: `ringlse.ring.head_parallel`).

`exchange(comm, ...)` takes tensors `[U, ...]` and returns tensors of the same shapes where slot i of
rank j's result is slot j of rank i's input. That map is its own inverse, so the backward is the same
exchange of the gradients. `dist.all_to_all_single` runs on NCCL and on gloo (CPU) alike.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ringlse.ring.comm import Pending, RingComm


def _post_and_wait(comm: RingComm, limit: datetime.timedelta | None, phase: str,
                   tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """One all-to-all per tensor, all posted before any is waited for; a failed or late one raises the
    ring's `RuntimeError` naming `phase` and the ranks waited for (`RingComm.wait`)."""
    sends = [t.contiguous() for t in tensors]
    recvs = [torch.empty_like(t) for t in sends]
    with comm.guard(phase):
        try:
            works = [dist.all_to_all_single(r, s, group=comm.group, async_op=True) for r, s in zip(recvs, sends)]
        except Exception as e:  # noqa: BLE001 - a peer already gone: a fault, as a failed wait
            raise comm.fault(phase, 0, comm.others(), e) from e
        comm.wait([Pending(w, tuple(comm.others()), 0) for w in works], phase, limit)
    return tuple(recvs)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, limit, phases, *tensors):
        ctx.set_materialize_grads(False)
        ctx.comm, ctx.limit, ctx.phase = comm, limit, phases[1]
        ctx.metas = [(t.shape, t.dtype, t.device) for t in tensors]
        return _post_and_wait(comm, limit, phases[0], tensors)

    @staticmethod
    def backward(ctx, *grads):
        # every rank exchanges every gradient, a zero one where its own is unused: the ranks' collectives
        # must match one for one whatever each rank's loss reads
        grads = tuple(torch.zeros(s, dtype=dt, device=dev) if g is None else g
                      for g, (s, dt, dev) in zip(grads, ctx.metas))
        return (None, None, None, *_post_and_wait(ctx.comm, ctx.limit, ctx.phase, grads))


def exchange(comm: RingComm, limit: datetime.timedelta | None, phases: tuple[str, str],
             *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """All-to-all of `tensors` over `comm`'s group, differentiable.

    Args:
        comm: the group's `RingComm` (its size U).
        limit: the longest one exchange may wait (None: the backend's own bound, as the ring's transfers).
        phases: what a fault report calls the forward and the backward exchange.
        tensors: `[U, ...]` each: slot j goes to group rank j.

    Returns:
        Tensors of the same shapes: slot i came from group rank i (the inputs themselves when U = 1).
    """
    if comm.world == 1:
        return tensors
    return _Exchange.apply(comm, limit, phases, *tensors)
