"""Ring attention over a `torch.distributed` group: the loop (`loop`), layouts and step plans
(`plan`), point-to-point transport (`comm`), copy-engine pulls within one host (`pull`) and the
agreement on inputs before any K/V moves (`agree`)."""

from ringlse.ring.comm import nccl_options, tune_nccl_env
from ringlse.ring.api import ring_attention
from ringlse.ring.plan import LAYOUTS, default_layout, shard, unshard

__all__ = ["LAYOUTS", "default_layout", "nccl_options", "ring_attention", "shard", "tune_nccl_env", "unshard"]
