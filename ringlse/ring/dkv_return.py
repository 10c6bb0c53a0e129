"""How the backward's dk/dv messages go home to the owners of the K/V blocks they answer: one interface
(`DkvReturn`) and its implementations, chosen by `dkv_return`:

- `DkvReturn`: point-to-point messages (NCCL, gloo on CPU), a batch per piece of keys;
- `CopyEngineReturn`: within one host, float32 pieces are built in slots of symmetric memory and pulled
  home by copy engines (`ringlse.ring.dkv_pull.PulledMessages`); a piece that does not fit a slot
  (masked calls kept whole) travels point-to-point. Both ends decide it from the same plan.

Per piece of keys the backward loop asks for `slot` (where to build our message), hands the built
messages to `send`, calls `settle` (the previous piece's transfers, waited for once this one is
built, so they hide behind it and what is alive stays three pieces, whatever W), then `post`s this
piece's send and receive. What arrived is added into float32 dk/dv in step and piece order: the same
sums on every run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ringlse.blocks.calls import BlockCall
from ringlse.checks import lse_dtype
from ringlse.kv_pack import KVPack
from ringlse.merge import PartSum
from ringlse.ring.call import RingCall, Transport
from ringlse.ring.comm import current_stream
from ringlse.ring.dkv_pull import PulledMessages
from ringlse.ring.kv_transport import DKV_TAG


class Message(NamedTuple):
    """One dk/dv message: the gradients of `calls` for keys `[k0, k1)` of the K/V owner's block, in `dtype`.
    Sender and receiver derive the same list from the same calls (`messages_of`), so a receiver knows
    every message's size and dtype without being told."""

    k0: int
    k1: int
    dtype: torch.dtype
    calls: list[BlockCall]


def messages_of(call: RingCall, calls: list[BlockCall], q: torch.Tensor, k: torch.Tensor) -> list[Message]:
    """The messages a piece's `calls` send home, grouped as the op's accumulation collects them."""
    acc = call.op.accumulation
    return [Message(min(c.k0 for c in group), max(c.k1 for c in group),
                    acc.message_dtype(group[0], q, k, call.with_lse), group) for group in acc.message_groups(calls)]


class DkvReturn:
    """dk/dv messages as point-to-point batches (see the module docstring)."""

    def __init__(self, call: RingCall, k: torch.Tensor, v: torch.Tensor):
        self.call, self.pack, self.device = call, KVPack.of(k, v), k.device
        # the previous piece's transfers: (works, what was sent, copy-engine arrivals, what comes in as
        # `(k0, k1, dk, dv)`), held until `settle`
        self.in_flight: tuple | None = None

    def slot(self, piece: int, messages: list[Message], step: int) -> torch.Tensor | None:
        """Where to build our only message of `piece` (a zeroed flat `KVPack` buffer of its rows), or None:
        anywhere."""
        return None

    def send(self, piece: int, dst: int, messages: list[Message], built: list[torch.Tensor]) -> list[torch.Tensor]:
        """Our messages of `piece` are built (queued): the tensors to send to `dst` point-to-point."""
        return built

    def _receive(self, piece: int, src: int, messages: list[Message], step: int) -> tuple[list, list]:
        """`(arrival events, [(k0, k1, dk, dv)])` of what `src` sends us for `piece` (point-to-point:
        buffers to receive into, no events)."""
        packs = [self.pack.rows(m.k1 - m.k0) for m in messages]
        return [], [(m.k0, m.k1, *p.views(p.empty(m.dtype, self.device))) for m, p in zip(messages, packs)]

    def post(self, piece: int, step: int, dst: int, sent: list[torch.Tensor], src: int,
             theirs: list[Message]) -> None:
        """Post our `sent` tensors to `dst` and the receipt of `theirs` from `src` (the previous piece settled)."""
        pulls, received = self._receive(piece, src, theirs, step) if theirs else ([], [])
        recvs = [t for *_, dk, dv in received for t in (dk, dv)] if not pulls else []
        works = self.call.comm.send_recv(sent, dst, recvs, src, DKV_TAG, step=step, phase="backward")
        self.in_flight = (works, sent, pulls, received)

    def settle(self, dk: PartSum, dv: PartSum) -> None:
        """Wait for the previous piece's transfers and add what came in into dk and dv."""
        if self.in_flight is None:
            return
        works, _, pulls, received = self.in_flight
        self.in_flight = None  # the sent tensors go with it
        self.call.comm.wait(works, "backward", self.call.limit)
        for arrived in pulls:
            current_stream().wait_event(arrived)
        for k0, k1, dk_part, dv_part in received:
            dk.accumulator()[:, k0:k1] += dk_part
            dv.accumulator()[:, k0:k1] += dv_part

    def finish(self) -> None:
        """After the last `settle`: every message is home."""

    def release(self) -> None:
        """After a failure: nothing of ours may wait on for a peer that is gone."""


class CopyEngineReturn(DkvReturn):
    """Float32 pieces pulled home by copy engines where they fit a slot (see the module docstring)."""

    def __init__(self, call: RingCall, k: torch.Tensor, v: torch.Tensor, slot_rows: int, dtype: torch.dtype):
        super().__init__(call, k, v)
        self.messages = PulledMessages(call.comm, self.pack, k.device, slot_rows, dtype, call.limit)

    def _by_copy(self, messages: list[Message]) -> bool:
        return len(messages) == 1 and self.messages.fits(messages[0].k1 - messages[0].k0)

    def slot(self, piece, messages, step):
        if not self._by_copy(messages):
            return None
        return self.messages.message(piece, messages[0].k1 - messages[0].k0, step)

    def send(self, piece, dst, messages, built):
        if not self._by_copy(messages):
            return built
        self.messages.send(piece, dst)
        return []

    def _receive(self, piece, src, messages, step):
        if not self._by_copy(messages):
            return super()._receive(piece, src, messages, step)
        m = messages[0]
        buf, arrived = self.messages.receive(piece, src, m.k1 - m.k0, step)
        return [arrived], [(m.k0, m.k1, *self.pack.rows(m.k1 - m.k0).views(buf))]

    def finish(self) -> None:
        self.messages.finish()

    def release(self) -> None:
        self.messages.release()


def dkv_return(call: RingCall, k: torch.Tensor, v: torch.Tensor, pieces: bool, slot_rows: int) -> DkvReturn:
    """The dk/dv return of a backward pass: copy engines where K/V travel so and the op builds float32
    pieces (`pieces`, of at most `slot_rows` keys) in buffers it is given; else point-to-point. Every
    rank makes the same choice (the agreed inputs and transport), and the copy-engine workspace is
    collective."""
    acc = call.op.accumulation
    if call.transport is Transport.COPY_ENGINE and pieces and acc.builds_into:
        return CopyEngineReturn(call, k, v, slot_rows, lse_dtype(k.dtype))
    return DkvReturn(call, k, v)
