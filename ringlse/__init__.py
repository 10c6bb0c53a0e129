"""ringlse: exact softmax attention from blocks.

Every block op returns its output and its log-sum-exp; `update_out_and_lse` / `merge_attn_states`
merge blocks exactly; `ring_attention` passes K/V around a `torch.distributed` ring. `import ringlse`
needs neither Triton nor a GPU: kernels load when first used.
"""

from ringlse.api import attention, block_attention
from ringlse.backends import available_backends, get_block_op
from ringlse.chunked import chunked_attention
from ringlse.layouts import shard, unshard
from ringlse.lse_toolkit import log_bmm, log_softmax, logsumexp, softmax
from ringlse.merge import merge_attn_states, update_out_and_lse
from ringlse.reference import reference_attention
from ringlse.ring import ring_attention
from ringlse.ring_comm import nccl_options, tune_nccl_env

__all__ = [
    "attention",
    "available_backends",
    "block_attention",
    "chunked_attention",
    "get_block_op",
    "log_bmm",
    "log_softmax",
    "logsumexp",
    "merge_attn_states",
    "nccl_options",
    "reference_attention",
    "ring_attention",
    "shard",
    "softmax",
    "tune_nccl_env",
    "unshard",
    "update_out_and_lse",
]
__version__ = "0.1.0"
