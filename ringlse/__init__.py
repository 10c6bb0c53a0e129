"""ringlse: exact softmax attention from blocks.

Every block op returns its output and its log-sum-exp; `update_out_and_lse` / `merge_attn_states`
merge blocks exactly; `ring_attention` passes K/V around a `torch.distributed` ring. `import ringlse`
needs neither Triton nor a GPU: kernels load when first used. Conventions: CONVENTIONS.md.
"""

from ringlse import testing
from ringlse.attention import attention, block_attention, chunked_attention, varlen_attention
from ringlse.blocks import available_backends, get_block_op
from ringlse.lse import log_bmm, log_softmax, logsumexp, softmax
from ringlse.merge_states import merge_attn_states, update_out_and_lse
from ringlse.reference import reference_attention
from ringlse.ring import nccl_options, ring_attention, shard, tune_nccl_env, unshard

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
    "testing",
    "tune_nccl_env",
    "unshard",
    "update_out_and_lse",
    "varlen_attention",
]
__version__ = "0.1.0"
