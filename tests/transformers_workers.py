"""Rank functions for tests/test_transformers.py: a tiny Llama run as a ring on gloo ranks, compared with
the same model run whole on every rank with transformers' own attention.

The reference loss is written here from the definition (next-token cross-entropy, no target at a
document's last token), not with `ring_loss`/`prepare_batch`, so they are checked too."""

from __future__ import annotations

import torch
import torch.nn.functional as F


# the tiny models' shared shape (2 layers, 4 query heads, GQA 4/2 unless a model says otherwise)
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def float64_ready(model):
    """`model` made to run and to matter in float64: eager experts (the grouped-matmul ones take no float64)
    and its learnable sinks, zeros at init, drawn with std 2."""
    model.config._experts_implementation = "eager"
    for module in model.modules():
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks, std=2.0)
    return model


def _tiny(config_class: str, model_class: str, seed: int, **overrides):
    """A transformers model of `TINY`'s shape with `overrides`, random weights from `seed`, float64."""
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**TINY, **overrides})
    return float64_ready(getattr(transformers, model_class)(config).double())


def tiny_llama(seed: int = 0, **overrides):
    """A 2-layer Llama with random weights (GQA 4/2), float64, no download."""
    return _tiny("LlamaConfig", "LlamaForCausalLM", seed, **overrides)


def tiny_gemma2(seed: int = 0):
    """A 2-layer Gemma 2 with random weights, logit softcapping (attn_logit_softcapping 0.5, made to bite
    with a scale of 1) and a sliding window of 6 on alternate layers, float64, no download."""
    return _tiny("Gemma2Config", "Gemma2ForCausalLM", seed, head_dim=16, sliding_window=6, attn_logit_softcapping=0.5,
                 query_pre_attn_scalar=1, **TOKEN_IDS)


def tiny_deepseek_v3(seed: int = 0):
    """A 2-layer DeepSeek-V3 with random weights and multi-head latent attention: q/k head dim 24 (16
    without rope + 8 with), v head dim 16, float64, no download. Every layer dense (its MoE layers run
    torch._grouped_mm, which takes no float64)."""
    return _tiny("DeepseekV3Config", "DeepseekV3ForCausalLM", seed, num_key_value_heads=4, q_lora_rank=None,
                 kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                 num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2, moe_intermediate_size=32,
                 **TOKEN_IDS)


def tiny_gemma3(seed: int = 0):
    """A 2-layer Gemma 3 (text) with random weights: a sliding window of 6 on its local layers, each kind of
    layer with its own rope, query/key norms, float64, no download."""
    return _tiny("Gemma3TextConfig", "Gemma3ForCausalLM", seed, head_dim=16, sliding_window=6, **TOKEN_IDS)


def tiny_gpt_oss(seed: int = 0):
    """A 2-layer GPT-OSS with random weights: a learnable sink per head (drawn with std 2, so that it
    matters; zeros at init), a sliding window of 6 on alternate layers, 4 experts, float64, no download."""
    return _tiny("GptOssConfig", "GptOssForCausalLM", seed, head_dim=16, sliding_window=6, num_local_experts=4,
                 num_experts_per_tok=2, **TOKEN_IDS)


# arch -> (the tiny model, the transformers attention it is compared with: sdpa is exact in float64;
# Gemma 2's softcapping only runs on eager, whose softmax rounds to float32; GPT-OSS's sinks run on eager,
# which computes in float64 but ignores packed position ids, so each of its documents runs alone)
ARCHS = {"llama": (tiny_llama, "sdpa"), "gemma2": (tiny_gemma2, "eager"), "gemma3": (tiny_gemma3, "sdpa"),
         "gpt_oss": (tiny_gpt_oss, "eager"), "deepseek_v3": (tiny_deepseek_v3, "sdpa")}
ALONE = {"gpt_oss"}


def packed_inputs(seqlen: int, docs: list[int] | None, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, position_ids)` `[1, seqlen]`: positions restart at 0 at every boundary of `docs`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (1, seqlen), generator=g)
    bounds = docs or [0, seqlen]
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]
    return ids, pos


def reference_loss(logits: torch.Tensor, ids: torch.Tensor, docs: list[int] | None) -> torch.Tensor:
    """Mean next-token cross-entropy over the whole sequence, no target past a document's end."""
    ends = set((docs or [0, ids.shape[1]])[1:])
    keep = [t for t in range(ids.shape[1] - 1) if t + 1 not in ends]
    return F.cross_entropy(logits[0, keep], ids[0, [t + 1 for t in keep]])


def whole_model(model, ids, pos, docs, implementation: str, alone: bool = False):
    """Logits and the mean loss's parameter gradients of the whole sequence on one process (`alone`: each
    document of `docs` run on its own, its logits concatenated)."""
    model.config._attn_implementation = implementation
    if alone and docs:
        logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(docs, docs[1:])], 1)
    else:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    grads = torch.autograd.grad(reference_loss(logits, ids, docs), list(model.parameters()))
    return logits.detach(), grads


def llama_rings(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """`llama_ring` for each case (one spawn of the ranks for all)."""
    return [llama_ring(rank, world, **case) for case in cases]


def llama_ring(rank: int, world: int, layout: str, seqlen: int, docs: list[int] | None, compiled: bool,
               arch: str = "llama", grid: tuple[int, int] | None = None) -> dict:
    """Max abs differences, ring vs whole (transformers' sdpa: exact in float64; eager rounds its
    softmax to float32), of logits and of parameter gradients summed over the ranks. `arch`: a key of
    `ARCHS` (`gemma2`: softcapping, which transformers' sdpa refuses: both references are its eager;
    `gpt_oss`: learnable sinks; `deepseek_v3`: a V head dim other than Q/K's). `grid=(U, R)`: head parallelism x ring over the groups
    of `head_parallel_workers.grid`."""
    import torch.distributed as dist
    import torch._dynamo
    import torch._dynamo.testing

    import ringlse
    from ringlse.integrations import transformers as rt

    rt.register()
    build, reference = ARCHS[arch]
    model = build()
    ids, pos = packed_inputs(seqlen, docs)
    ref_logits, ref_grads = whole_model(model, ids, pos, docs, reference, alone=arch in ALONE)
    eager_logits = ref_logits if reference == "eager" else whole_model(model, ids, pos, docs, "eager")[0]

    model.config._attn_implementation = "ringlse"
    groups = {}
    if grid is not None:
        from head_parallel_workers import grid as make_grid

        groups = dict(zip(("group", "head_group"), make_grid(*grid)))
    batch = rt.prepare_batch(ids, position_ids=pos, layout=layout, **groups)
    forward = model
    frames = None
    if compiled:
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        forward = torch.compile(model, backend=counter, fullgraph=True)
    with rt.ring(layout=layout, cu_seqlens=batch.cu_seqlens, **groups):
        logits = forward(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    grads = torch.autograd.grad(rt.ring_loss(logits, batch), list(model.parameters()))
    if compiled:
        frames = counter.frame_count
    for g in grads:
        dist.all_reduce(g)
    full = ringlse.unshard(logits.detach(), layout, cu_seqlens=batch.cu_seqlens, **groups)
    return {
        "logits": (full - ref_logits).abs().max().item(),
        "logits_vs_eager": (full - eager_logits).abs().max().item(),
        "grads": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads)),
        "grad_scale": max(r.abs().max().item() for r in ref_grads),
        "frames": frames,
    }


def refused_in_ring(rank: int, world: int) -> dict[str, str]:
    """Inside `ring()`, keywords the attention does not compute raise on this rank (every rank gets the
    same keywords; softcap, sinks and a V head dim of its own are computed: "no error"); the group still
    works after them."""
    import torch.distributed as dist

    from ringlse.integrations import transformers as rt

    class Module(torch.nn.Module):
        is_causal = True

    q, k = torch.randn(1, 4, 6, 8, dtype=torch.float64), torch.randn(1, 2, 6, 8, dtype=torch.float64)
    attempts = {"s_aux": dict(s_aux=torch.zeros(4)), "softcap": dict(softcap=20.0), "mla": dict(v=k[..., :4])}
    messages = {}
    with rt.ring(layout="contiguous"):
        for name, kw in attempts.items():
            v = kw.pop("v", k)
            try:
                rt.attention_forward(Module(), q, k, v, None, **kw)
                messages[name] = "no error"
            except (NotImplementedError, ValueError) as e:
                messages[name] = str(e)
        out, _ = rt.attention_forward(Module(), q, k, k, None)
    x = torch.ones(1)
    dist.all_reduce(x)
    messages["after"] = "ok" if x.item() == world and out.shape == (1, 6, 4, 8) else "broken"
    return messages
