"""One ring call as the loops see it (`RingCall`): the block op, the step plans, how K/V travel, and the
bounds of every wait; made once by `ringlse.ring.entry.ring_plan` after every check."""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass

from ringlse.blocks.calls import BlockCall
from ringlse.blocks.contract import BlockOp
from ringlse.ring.comm import RingComm
from ringlse.ring.plan import Route

StepPlans = tuple[tuple[BlockCall, ...], ...]


class Transport(enum.Enum):
    """How K/V blocks (and the backward's float32 dk/dv pieces) travel between the ranks."""

    P2P = "point-to-point"  # torch.distributed messages (NCCL kernels, gloo on CPU)
    COPY_ENGINE = "copy engines"  # pulled from the peers' symmetric memory within one host (`ringlse.ring.pull`)


@dataclass(frozen=True)
class RingCall:
    """Everything of one ring call that is the same for its forward and its backward.

    `plans[s]`: this rank's block calls at step s (K/V of rank (rank - s) mod W); `peer_plans[s]`: those
    of rank (rank + s) mod W at its step s, when it holds our K/V (`ringlse.ring.plan.step_plans`).
    `limit`: how long one K/V or dk/dv wait may take (`RingComm.transfer_limit`)."""

    op: BlockOp
    scale: float
    comm: RingComm
    plans: StepPlans
    peer_plans: StepPlans
    route: Route
    transport: Transport
    with_lse: bool
    limit: datetime.timedelta | None
    softcap: float = 0.0  # 0: off
