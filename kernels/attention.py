"""The Triton block op: forward with lse and in-kernel merge, delta, and backward kernels.

`ringlse.backends` maps backend "triton" to `TRITON_BLOCK_OP`; `ringlse.block_attention` /
`ringlse.attention` wrap it in autograd (including lse gradients), so no autograd.Function lives here.
"""

from __future__ import annotations

from ringlse.blockop import BlockOp
from ringlse.kernels.attention_bwd import attention_backward, attention_delta
from ringlse.kernels.attention_fwd import attention_forward

TRITON_BLOCK_OP = BlockOp("triton", attention_forward, attention_backward, delta=attention_delta)

__all__ = ["TRITON_BLOCK_OP", "attention_backward", "attention_delta", "attention_forward"]
