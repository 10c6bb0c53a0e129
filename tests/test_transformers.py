"""The transformers integration (`ringlse.integrations.transformers`): a tiny Llama with
`attn_implementation="ringlse"`, as a ring on gloo ranks and on one process, eager and compiled,
against the same model run whole with transformers' own attention (float64).

transformers' `sdpa` attention is exact in float64 on the CPU and is the reference (tolerance 1e-9);
its `eager` attention rounds the softmax to float32, so it is compared at float32's scale."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers_workers as tw  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from ringlse.integrations import transformers as rt  # noqa: E402

EXACT = 1e-9
FLOAT32_SOFTMAX = 1e-6


def _rings_equal_whole(world: int, tmp_path, cases: list[dict], bound: float, timeout: int = 400) -> list[tuple]:
    """Run `cases` on `world` ranks (`transformers_workers.llama_rings`) and assert logits and every
    parameter gradient within `bound` of the whole model; returns `(where, case, result)` per rank and case."""
    out = []
    for rank, results in enumerate(run_ranks(tw.llama_rings, world, tmp_path, cases, timeout=timeout)):
        for case, r in zip(cases, results):
            where = f"W={world} rank {rank} {case}"
            assert r["logits"] <= bound, (where, r)
            assert r["grads"] <= bound, (where, r)
            out.append((where, case, r))
    return out


LAYOUTS = ("contiguous", "zigzag", "stripe")


def _docs(seqlen: int) -> list[int]:
    """Documents crossing shard boundaries, one of length 1, none aligned to the layout."""
    return [0, 7, seqlen // 2 + 3, seqlen // 2 + 4, seqlen]


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_llama_ring_equals_whole_model(world, tmp_path):
    seqlen = 2 * world * 11  # zigzag halves of 11 tokens
    cases = [dict(layout=layout, seqlen=seqlen, docs=docs, compiled=False)
             for layout in LAYOUTS for docs in (None, _docs(seqlen))]
    cases.append(dict(layout="zigzag", seqlen=seqlen, docs=_docs(seqlen), compiled=True))
    for where, case, r in _rings_equal_whole(world, tmp_path, cases, EXACT):
        assert r["logits_vs_eager"] <= FLOAT32_SOFTMAX, where
        if case["compiled"]:
            assert r["frames"] == 1, f"{where}: {r['frames']} graphs (a graph break)"


def test_llama_head_parallel_ring_equals_whole_model(tmp_path):
    """`ring(head_group=)` and `prepare_batch(head_group=)`: 4 ranks as 2 head-group ranks x a ring of 2
    (the tiny Llama's 4 query / 2 K/V heads split over U = 2), equal to the whole model."""
    seqlen = 44  # zigzag over R = 2 (a multiple of 4), ring parts of 22 cut into pieces of 11
    cases = [dict(layout="zigzag", seqlen=seqlen, docs=_docs(seqlen), compiled=False, grid=(2, 2)),
             dict(layout="stripe", seqlen=seqlen, docs=None, compiled=False, grid=(2, 2))]
    _rings_equal_whole(4, tmp_path, cases, EXACT)


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_gemma2_softcap_ring_equals_whole_model(world, tmp_path):
    """Gemma 2's logit softcapping (and its sliding window) through the ring, against the whole model on
    transformers' eager attention (sdpa refuses softcap; eager's softmax rounds to float32)."""
    seqlen = 2 * world * 11
    cases = [dict(layout=layout, seqlen=seqlen, docs=docs, compiled=False, arch="gemma2")
             for layout, docs in (("contiguous", None), ("zigzag", _docs(seqlen)))]
    _rings_equal_whole(world, tmp_path, cases, FLOAT32_SOFTMAX, timeout=300)


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_gpt_oss_sinks_ring_equals_whole_model(world, tmp_path):
    """GPT-OSS's learnable sinks (and its sliding window on alternate layers) through the ring: each sink
    counted once per row however many ranks hold its keys, with its own gradient, against the whole model
    on transformers' eager attention (exact in float64; its packed documents run one by one)."""
    seqlen = 2 * world * 11
    cases = [dict(layout=layout, seqlen=seqlen, docs=docs, compiled=False, arch="gpt_oss")
             for layout, docs in (("zigzag", None), ("stripe", _docs(seqlen)))]
    _rings_equal_whole(world, tmp_path, cases, EXACT, timeout=300)


def test_gemma3_ring_equals_whole_model(tmp_path):
    """Gemma 3's local (windowed) and global layers through the ring, packed documents included, against
    the whole model on transformers' sdpa attention. Gemma's RMSNorms (its query/key norms among them)
    compute in float32, so the ring's last-bit differences in float64 can flip a float32 rounding on the
    way back: gradients agree at float32's scale (1.4e-9 seen), logits exactly."""
    seqlen = 2 * 2 * 11
    cases = [dict(layout=layout, seqlen=seqlen, docs=docs, compiled=False, arch="gemma3")
             for layout, docs in (("zigzag", _docs(seqlen)), ("contiguous", None))]
    for where, _, r in _rings_equal_whole(2, tmp_path, cases, FLOAT32_SOFTMAX, timeout=300):
        assert r["logits"] <= EXACT, (where, r)


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_deepseek_v3_mla_ring_equals_whole_model(world, tmp_path):
    """DeepSeek-V3's multi-head latent attention (q/k head dim 24, v head dim 16) through the ring, against
    the whole model on transformers' sdpa attention (exact in float64), packed documents included."""
    seqlen = 2 * world * 11
    cases = [dict(layout=layout, seqlen=seqlen, docs=docs, compiled=False, arch="deepseek_v3")
             for layout, docs in (("zigzag", None), ("stripe", _docs(seqlen)))]
    _rings_equal_whole(world, tmp_path, cases, EXACT, timeout=300)


def test_packed_documents_equal_documents_one_by_one():
    rt.register()
    model = tw.tiny_llama()
    model.config._attn_implementation = "ringlse"
    docs = [0, 9, 10, 41]
    ids, pos = tw.packed_inputs(41, docs)
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    alone = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(docs, docs[1:])], 1)
    assert (packed - alone).abs().max().item() <= EXACT
    with rt.ring(layout="contiguous", cu_seqlens=docs):  # one rank, documents by boundaries instead of position restarts
        by_bounds = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert (by_bounds - alone).abs().max().item() <= EXACT


def test_compiled_model_has_no_graph_break():
    import torch._dynamo
    import torch._dynamo.testing

    rt.register()
    model = tw.tiny_llama()
    model.config._attn_implementation = "ringlse"
    ids, pos = tw.packed_inputs(40, None)
    eager = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    g_eager = torch.autograd.grad(eager.square().mean(), list(model.parameters()))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    out = compiled(input_ids=ids, position_ids=pos, use_cache=False).logits
    g = torch.autograd.grad(out.square().mean(), list(model.parameters()))
    assert counter.frame_count == 1
    assert (out - eager).abs().max().item() <= EXACT
    assert max((a - b).abs().max().item() for a, b in zip(g, g_eager)) <= EXACT


def test_padding_mask_and_dropout_are_refused():
    rt.register()
    model = tw.tiny_llama()
    model.config._attn_implementation = "ringlse"
    ids, _ = tw.packed_inputs(12, None)
    mask = torch.ones_like(ids)
    model(input_ids=ids, attention_mask=mask, use_cache=False)  # nothing padded: accepted
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    model.train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=ids, use_cache=False)


def test_sliding_window_model():
    """A Mistral-style model with sliding_window: ringlse equals transformers' sdpa (which builds the
    dense windowed mask)."""
    from transformers import MistralConfig, MistralForCausalLM

    rt.register()
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=5, attention_dropout=0.0)
    model = MistralForCausalLM(cfg).double()
    ids, pos = tw.packed_inputs(33, None)
    outs = {}
    for impl in ("sdpa", "ringlse"):
        model.config._attn_implementation = impl
        outs[impl] = model(input_ids=ids, use_cache=False).logits
    assert (outs["ringlse"] - outs["sdpa"]).abs().max().item() <= EXACT
    model.config.sliding_window = None  # the window mattered: without it the logits change
    assert (model(input_ids=ids, use_cache=False).logits - outs["ringlse"]).abs().max().item() > 1e-3


def test_compiled_model_reuses_its_graph_across_document_layouts():
    """Each batch packs other documents: under `ring(cu_seqlens=...)` the boundaries are a graph input,
    not a constant, so new boundaries do not recompile (a new number of documents may, once)."""
    import torch._dynamo
    import torch._dynamo.testing

    rt.register()
    model = tw.tiny_llama()
    model.config._attn_implementation = "ringlse"
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for docs in ([0, 9, 40], [0, 25, 40], [0, 3, 17, 40], [0, 1, 2, 30, 40]):
        ids, pos = tw.packed_inputs(40, docs)
        with rt.ring(layout="contiguous", cu_seqlens=docs):
            got = compiled(input_ids=ids, position_ids=pos, use_cache=False).logits
        alone = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(docs, docs[1:])], 1)
        assert (got - alone).abs().max().item() <= EXACT, docs
    assert counter.frame_count <= 2
