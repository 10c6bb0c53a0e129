"""What one block-op call is given: which rows attend which keys under which mask (`BlockCall`), the
typed arguments a block op takes for it (`BlockArgs`), and a block's gradients as parts (`BlockGrads`).
"""

from __future__ import annotations

from typing import NamedTuple

from ringlse.masks import Intervals
from ringlse.merge import GradPart


class BlockArgs(NamedTuple):
    """The arguments of a block-op call besides its tensors (`ringlse.blocks.contract`): the scale and
    the mask, plain (`causal` with `q_start`/`k_start`), through `intervals` (with `causal=False`) or
    as a window rule (`window`, for ops with `Masks.WINDOW`); `softcap` (0: off) caps the scaled scores
    to `softcap * tanh(score / softcap)`, for ops with `Capabilities.softcap`."""

    softmax_scale: float
    causal: bool
    q_start: int
    k_start: int
    intervals: Intervals | None = None
    window: tuple[int, int] | None = None
    softcap: float = 0.0

    def kwargs(self) -> dict:
        """The block op's keyword arguments (an op is only given the mask arguments it takes, and
        `softcap` only when it is on: ops without `Capabilities.softcap` are refused before that)."""
        kw = dict(softmax_scale=self.softmax_scale, causal=self.causal, q_start=self.q_start, k_start=self.k_start)
        if self.softcap:
            kw["softcap"] = self.softcap
        if self.intervals is not None:
            kw["intervals"] = self.intervals
        if self.window is not None:
            kw["window_size"] = self.window
        return kw


class BlockCall(NamedTuple):
    """One block-op call of a plan: query rows `[q0, q1)` attend key rows `[k0, k1)`, plain (`causal`,
    with `q_start`/`k_start` positions in any frame where only their difference matters: global
    positions for single-device plans, local indices for the ring's, `ringlse.ring.plan.plan_step`) or
    through `intervals` (with `causal=False`: windows, documents, `ringlse.masks`)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    q_start: int
    k_start: int
    intervals: Intervals | None = None
    window: tuple[int, int] | None = None  # for ops that take windows as a rule (`Masks.WINDOW`)

    def args(self, softmax_scale: float, softcap: float = 0.0) -> BlockArgs:
        """This call's `BlockArgs`."""
        return BlockArgs(softmax_scale, self.causal, self.q_start, self.k_start, self.intervals, self.window,
                         softcap)

    def block_args(self) -> dict:
        """The mask arguments of a block-op call for this call (as keywords)."""
        kw = self.args(0.0).kwargs()
        del kw["softmax_scale"]
        return kw


class BlockGrads(NamedTuple):
    """One block's gradients as parts: dq parts index the block's query rows, dk/dv parts its key rows."""

    dq: list[GradPart]
    dk: list[GradPart]
    dv: list[GradPart]
