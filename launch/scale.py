"""Training at scale (`launch/train.py --scale`): a Llama-shaped model sharded with FSDP2 over the same ranks
as the ring, activation checkpointing per decoder layer, optional `torch.compile` per layer, bf16 compute
with float32 master weights, and attention by ringlse's ring or by PyTorch context parallel (SDPA with its
own load balancer) on the same model, ranks and tokens.

Every rank passes the same global batch; each step prints the loss, and rank 0 writes one JSON record with
tokens/s per GPU, MFU (model FLOPs over the visible pairs, recomputation not counted), peak memory per rank
and the loss curve. Out of memory ends every rank with exit code 3 (torchrun stops the others), so a driver
can double the tokens until a run does not fit (`benchmarks/train_scale.py`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ringlse
from ringlse.integrations import transformers as rt
from ringlse.masks import Rule, visible_per_position

# Llama-3-shaped configurations (random weights, no download). llama-1b is Llama-3.2-1B's shape with an
# untied output head (FSDP2 re-ties nothing after a meta-device init).
PRESETS = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8),
}
# dense bf16 tensor-core peak per GPU (the vendors' datasheets), for MFU
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}
CP_ATTENTION = "ringlse-torch-cp-sdpa"  # transformers' SDPA without a mask, for PyTorch context parallel
LOSS_CHUNK = 4096  # tokens per chunk of the output head and loss: a 128K-token vocabulary's logits never whole
OUT_OF_MEMORY = 3


class ChunkedLoss(nn.Module):
    """The causal LM with its loss computed in checkpointed chunks of tokens (FSDP2's root module)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids, labels, num_tokens: int) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        head = self.lm.lm_head

        def chunk_loss(h, y):
            return F.cross_entropy(head(h).float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")

        total = sum(checkpoint(chunk_loss, hidden[:, i:i + LOSS_CHUNK], labels[:, i:i + LOSS_CHUNK],
                               use_reentrant=False) for i in range(0, hidden.shape[1], LOSS_CHUNK))
        return total / max(num_tokens, 1)


def _cp_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, causal with no mask tensor (context parallel shards no mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise ValueError("torch-cp: an attention mask cannot be sharded by context parallel")
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def compute_dtype(args) -> torch.dtype:
    """What the layers compute in: bf16 casts of the float32 master weights, or the float32 weights."""
    return torch.bfloat16 if args.dtype == "bf16" else torch.float32


def build(args, world: int, device: torch.device) -> tuple[nn.Module, dict]:
    """The FSDP2-sharded `ChunkedLoss` model and its shape; weights from `args.seed`, the same for any W."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rt.register()
    AttentionInterface.register(CP_ATTENTION, _cp_sdpa)
    impl = CP_ATTENTION if args.attention == "torch-cp" else rt.NAME
    cfg = LlamaConfig(**PRESETS[args.model], max_position_embeddings=args.tokens, attention_dropout=0.0,
                      attn_implementation=impl)
    with torch.device("meta"):
        lm = LlamaForCausalLM(cfg)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype(args), reduce_dtype=torch.float32)
    layers = lm.model.layers
    for i, layer in enumerate(layers):
        layer = checkpoint_wrapper(layer)
        if args.compile:
            layer = torch.compile(layer)
        fully_shard(layer, mp_policy=mp)
        layers[i] = layer
    model = ChunkedLoss(lm)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    with torch.device(device):  # its buffer is computed at init (to_empty left it unset): built again here
        lm.model.rotary_emb = LlamaRotaryEmbedding(config=cfg)
    _init_weights(model, args.seed, world, device)
    n_params = sum(p.numel() for p in model.parameters())
    embed = cfg.vocab_size * cfg.hidden_size
    shape = dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                 kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
                 vocab=cfg.vocab_size, params=n_params, params_without_embedding=n_params - embed)
    return model, shape


@torch.no_grad()
def _init_weights(model: nn.Module, seed: int, world: int, device: torch.device) -> None:
    """Llama's initialisation (matrices N(0, 0.02), norms 1), each full tensor drawn from a generator seeded by
    its name and this rank's FSDP2 shard (dim-0 chunk) kept: the same weights for any number of ranks."""
    rank = dist.get_rank()
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel() == 0:
            continue
        if p.dim() == 1:
            local.fill_(1.0)
            continue
        key = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        full = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).mul_(0.02)
        local.copy_(torch.chunk(full, world, dim=0)[rank] if local.shape != full.shape else full)


def model_flops(shape: dict, tokens: int, pairs: int) -> float:
    """FLOPs of one training step (forward + backward, recomputation not counted): 6 per parameter and token
    outside the embedding, and 12·d per visible pair and query head in each layer's attention."""
    return 6.0 * shape["params_without_embedding"] * tokens + \
        12.0 * shape["layers"] * shape["heads"] * shape["head_dim"] * pairs


def _step_ringlse(model, ids, pos, args, group, world, num_tokens) -> torch.Tensor:
    batch = rt.prepare_batch(ids, position_ids=pos if args.documents else None, group=group, layout=args.layout)
    # backward inside the ring context: checkpointed layers run their attention again there
    with rt.ring(group=group, layout=args.layout, cu_seqlens=batch.cu_seqlens, backend=args.backend):
        loss = model(batch.input_ids, batch.position_ids, batch.labels, num_tokens)
        (loss * world).backward()  # FSDP2 averages the ranks' gradients; they sum to the batch's
    return loss.detach()


def _step_torch_cp(model, ids, pos, args, mesh, world, num_tokens) -> torch.Tensor:
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    _cp_options.enable_load_balance = True
    whole = rt.whole_batch(ids)
    bufs = [whole.input_ids.clone(), whole.labels.clone(), whole.position_ids.clone()]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(bufs)):
        loss = model(bufs[0], bufs[2], bufs[1], num_tokens)
        (loss * world).backward()
    return loss.detach()


def run(args, packed_batch) -> dict | None:
    """Train `args.steps` steps under torchrun; rank 0 returns the record (None elsewhere)."""
    from tqdm import tqdm

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dp, ring = args.dp, world // args.dp
    sequences = args.sequences or dp
    if world % dp or sequences % dp:
        raise ValueError(f"--dp {dp} must divide the {world} ranks and the {sequences} sequences per step")
    if args.documents and sequences != dp:
        raise ValueError("--documents takes one sequence per data-parallel group (each its own documents)")
    model, shape = build(args, world, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # data-parallel group g holds ranks g*ring .. g*ring + ring - 1; each ring gets its own communicator,
    # beside FSDP2's over all ranks
    groups = [dist.new_group(list(range(g * ring, (g + 1) * ring))) for g in range(dp)]
    mine, group = rank // ring, groups[rank // ring]
    mesh = None
    if args.attention == "torch-cp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dp, ring), mesh_dim_names=("dp", "cp"))["cp"]
    losses, times, pairs = [], [], []
    bar = tqdm(range(args.steps), disable=rank != 0, desc=f"{args.attention} {args.model} W={world}", unit="step")
    per_group = sequences // dp
    for step in bar:
        seqs = [packed_batch(args, step * sequences + j, args.tokens) for j in range(sequences)]
        wholes = [rt.whole_batch(ids, position_ids=pos if args.documents else None) for ids, pos in seqs]
        # the global batch's label count: every rank's loss is its share of the mean over all of them
        num_tokens = sum(w.num_tokens for w in wholes)
        pairs.append(sum(int(visible_per_position(Rule(True, docs=w.cu_seqlens), args.tokens).sum())
                         for w in wholes))
        local = seqs[mine * per_group:(mine + 1) * per_group]
        ids, pos = (torch.cat([t[i] for t in local]).to(device) for i in (0, 1))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if args.attention == "torch-cp":
            loss = _step_torch_cp(model, ids, pos, args, mesh, world, num_tokens)
        else:
            loss = _step_ringlse(model, ids, pos, args, group, world, num_tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss)
        losses.append(loss.item())  # synchronises
        times.append(time.perf_counter() - t0)
        if rank == 0:
            bar.write(f"step {step:3d}  loss {losses[-1]:.6f}  {times[-1]:.3f} s")
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    timed = slice(args.warmup, None) if len(times) > args.warmup else slice(None)
    step_s = statistics.median(times[timed])
    tokens = sequences * args.tokens
    # each step packs new documents, so its work differs: FLOPs and time summed over the same steps
    flops = [model_flops(shape, tokens, p) for p in pairs[timed]]
    flops_per_s = sum(flops) / sum(times[timed])
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
    ringlse_attention = args.attention == "ringlse"
    return dict(model=args.model, attention=args.attention, documents=args.documents, tokens_per_step=tokens,
                seqlen=args.tokens, sequences=sequences, data_parallel=dp, ring=ring, world=world,
                layout=args.layout if ringlse_attention else "torch-cp load balancer",
                backend=_ring_backend(args, device, shape) if ringlse_attention else "sdpa", compile=args.compile,
                dtype=args.dtype, fits=True, step_s=step_s, step_times_s=times, losses=losses,
                tokens_per_s_per_gpu=tokens / step_s / world,
                model_tflops_per_step=statistics.mean(flops) / 1e12,
                mfu=None if peak_tflops is None else flops_per_s / world / (peak_tflops * 1e12),
                peak_mem_gib=peak.item(), visible_pairs=round(statistics.mean(pairs[timed])),
                visible_pairs_per_step=pairs, gpu=gpu, torch=torch.__version__,
                ringlse=getattr(ringlse, "__version__", None), command=" ".join(sys.argv), **shape)


def _ring_backend(args, device: torch.device, shape: dict) -> str:
    """The block op the ring ran (what `auto` picked on this machine, so that a record says it)."""
    from ringlse.blocks import get_block_op

    return get_block_op(args.backend, device, compute_dtype(args), masked=args.documents and args.backend == "auto",
                        head_dim=shape["head_dim"]).name


def _plot_losses(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(record["losses"])
    ax.set(xlabel="step", ylabel="loss", title=f"{record['model']}, {record['attention']}, W = {record['world']}, "
           f"{record['tokens_per_step']} tokens per step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args, packed_batch) -> int:
    """`launch/train.py --scale`: one configuration; exit 3 if it runs out of memory."""
    rank = dist.get_rank()
    try:
        record = run(args, packed_batch)
    except torch.OutOfMemoryError as e:
        print(f"rank {rank}: out of memory at {args.tokens} tokens per step: {str(e).splitlines()[0]}",
              file=sys.stderr, flush=True)
        os._exit(OUT_OF_MEMORY)
    if record is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = (f"scale-{args.model}-{args.attention}-{record['tokens_per_step']}{'-docs' if args.documents else ''}"
                f"-W{record['world']}")
        path = args.out / f"{name}.json"
        path.write_text(json.dumps(record, indent=1))
        _plot_losses(record, path.with_suffix(".png"))
        mfu = "" if record["mfu"] is None else f", MFU {record['mfu']:.3f}"
        print(f"{args.attention}: {record['tokens_per_s_per_gpu']:.0f} tokens/s per GPU{mfu}, peak "
              f"{record['peak_mem_gib']:.1f} GiB per rank -> {path}", flush=True)
    return 0

