"""Ring attention over a `torch.distributed` group.

| module         | what                                                                       |
| -------------- | -------------------------------------------------------------------------- |
| `api`          | `ring_attention`: the options into a `RingSpec`, then `ringlse.ops`        |
| `head_parallel`| `head_group=`: all-to-all of heads around the ring (CONVENTIONS §5.1)     |
| `head_split`   | how a head group splits a ring part's positions and heads                  |
| `all_to_all`   | the differentiable all-to-all of the head group                            |
| `entry`        | `ring_plan`: checks, the agreement, the plan of a call                     |
| `forward`      | the forward loop                                                           |
| `backward`     | the backward loop and how a step's gradients are cut into pieces           |
| `kv_transport` | how K/V blocks move: NCCL neighbour, NCCL direct, copy engine              |
| `dkv_return`   | how dk/dv go home to their owner: NCCL, copy engine                        |
| `pull`         | copy-engine pulls of K/V within one host (symmetric memory)                |
| `dkv_pull`     | copy-engine pulls of the backward's float32 dk/dv pieces                   |
| `comm`         | point-to-point plumbing, fault reporting, NCCL settings                    |
| `agreement`    | the ranks' agreement on inputs before any K/V moves (`AgreementRow`)       |
| `layout`       | sequence layouts, `shard`/`unshard`                                        |
| `plan`         | per-step block plans and routes                                            |
| `call`         | `RingCall`: one call's op, plans, route, transport and limits              |
"""

from ringlse.ring.comm import nccl_options, tune_nccl_env
from ringlse.ring.api import ring_attention
from ringlse.ring.layout import LAYOUTS, default_layout, shard, unshard

__all__ = ["LAYOUTS", "default_layout", "nccl_options", "ring_attention", "shard", "tune_nccl_env", "unshard"]
