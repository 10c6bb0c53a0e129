"""Never silently wrong through transformers: tiny random-init models of many architectures run with
`attn_implementation="ringlse"` either equal the same model on transformers' own `sdpa` attention
(float64, logits and every parameter gradient, packed documents included; Gemma 2's softcapping, which
transformers' sdpa refuses, against its `eager` attention, whose softmax rounds to float32) or raise an
error naming the feature ringlse does not compute; every keyword transformers passes to an attention function is either
computed, ignored on purpose (`IGNORED_KEYWORDS`, one test each) or refused (one test each)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_harness import run_ranks  # noqa: E402
import transformers_workers as tw  # noqa: E402
import ringlse  # noqa: E402
from ringlse.integrations import transformers as rt  # noqa: E402

EXACT = 1e-9
# transformers' eager attention computes its softmax in float32 (`eager_attention_forward`), as
# tests/test_transformers.py's FLOAT32_SOFTMAX
FLOAT32_SOFTMAX = 1e-6
# the transformers attention a model is compared with, and how closely, where not sdpa exactly: models
# whose sdpa path drops a feature they use (GPT-OSS's eager attention computes in float64)
REFERENCE = {"gemma2-softcap": ("eager", FLOAT32_SOFTMAX), "gpt_oss-sinks": ("eager", EXACT)}
# models compared with each packed document run alone (their eager path ignores packed position ids)
ALONE_REFERENCE = {"gpt_oss-sinks"}
COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
# name: (config class, model class, config overrides, None or the error the model must raise)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, None),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7), None),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=5,
                                                             max_window_layers=1), None),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16), None),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16), None),
    "gemma2-softcap": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=6), None),
    "gemma2-nocap": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=6,
                                                               attn_logit_softcapping=None), None),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=6), None),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, None),
    "phi": ("PhiConfig", "PhiForCausalLM", {}, None),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}, None),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, None),
    "starcoder2-window": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=6), None),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}, None),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}, None),
    "gpt_oss-sinks": ("GptOssConfig", "GptOssForCausalLM", dict(head_dim=16, sliding_window=6, num_local_experts=4,
                                                                num_experts_per_tok=2), None),
    # every layer dense (first_k_dense_replace = num_hidden_layers): its MoE layers run torch._grouped_mm, which
    # takes no float64
    "deepseek_v3-mla": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                             qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                             topk_group=1, first_k_dense_replace=2, moe_intermediate_size=32), None),
}



def build(name: str):
    config_class, model_class, overrides, _ = ARCHS[name]
    if not hasattr(transformers, model_class):
        pytest.skip(f"transformers {transformers.__version__} has no {model_class}")
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**COMMON, **overrides})
    return tw.float64_ready(getattr(transformers, model_class)(config).double())


def _run(model, implementation: str, ids, pos, docs=None):
    """Logits and the parameter gradients of a loss over them; with `docs`, each document run alone."""
    model.config._attn_implementation = implementation
    if docs is None:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    else:
        logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(docs, docs[1:])], 1)
    grads = torch.autograd.grad(logits.square().mean(), list(model.parameters()), allow_unused=True)
    return logits.detach(), grads


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("docs", [None, [0, 9, 10, 29]], ids=["one-doc", "packed"])
def test_model_equals_transformers_or_names_the_feature(name, docs):
    rt.register()
    model = build(name)
    ids, pos = tw.packed_inputs(29, docs)
    refused = ARCHS[name][3]
    if refused is not None:
        with pytest.raises(NotImplementedError, match=refused):
            _run(model, "ringlse", ids, pos)
        return
    implementation, bound = REFERENCE.get(name, ("sdpa", EXACT))
    ref_logits, ref_grads = _run(model, implementation, ids, pos, docs if name in ALONE_REFERENCE else None)
    logits, grads = _run(model, "ringlse", ids, pos)
    assert (logits - ref_logits).abs().max().item() <= bound
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:
            assert (g - r).abs().max().item() <= bound


# ---- keyword by keyword, through the attention function itself ---------------------------------------

class _Module(torch.nn.Module):
    is_causal = True


def _qkv(seed: int = 0, s: int = 11, dv: int = 8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, s, 8, generator=g, dtype=torch.float64),
            torch.randn(1, 2, s, 8, generator=g, dtype=torch.float64),
            torch.randn(1, 2, s, dv, generator=g, dtype=torch.float64))


def _call(**kwargs):
    return rt.attention_forward(_Module(), *_qkv(), None, scaling=0.3, **kwargs)[0]


IGNORED_VALUES = {"use_cache": True, "cache_position": torch.arange(11), "max_length_q": 11, "max_length_k": 11,
                  "deterministic": True, "output_hidden_states": True, "output_router_logits": True,
                  "num_items_in_batch": torch.tensor(7), "return_dict": True}


def test_every_ignored_keyword_has_a_test_value():
    assert set(IGNORED_VALUES) == set(rt.IGNORED_KEYWORDS)


@pytest.mark.parametrize("name", list(IGNORED_VALUES))
def test_ignored_keyword_leaves_the_result_unchanged(name):
    assert torch.equal(_call(**{name: IGNORED_VALUES[name]}), _call())


REFUSED = [
    ("position_bias", torch.zeros(1, 4, 11, 11), "position bias"),
    ("head_mask", torch.ones(4), "per-head mask"),
    ("indices", torch.zeros(1, 11, 4, dtype=torch.long), "sparse attention"),
    ("topk_indices", torch.zeros(1, 11, 4, dtype=torch.long), "sparse attention"),
    ("prev_topk_indices", torch.zeros(1, 11, 4, dtype=torch.long), "sparse attention"),
    ("block_indices", torch.zeros(1, 4, dtype=torch.long), "block-sparse"),
    ("seq_idx", torch.zeros(1, 11, dtype=torch.int32), "sequence indices"),
    ("output_attentions", True, "no attention weights"),
    ("alibi_slopes", torch.ones(4), "does not know the keyword alibi_slopes"),
]


@pytest.mark.parametrize(("name", "value", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_keyword_names_the_feature(name, value, message):
    with pytest.raises(NotImplementedError, match=message) as err:
        _call(**{name: value})
    assert name in str(err.value)


@pytest.mark.parametrize(("name", "plain"), [("softcap", None), ("softcap", 0.0), ("s_aux", None), ("sinks", None),
                                             ("position_bias", None), ("head_mask", None), ("indices", None),
                                             ("seq_idx", None), ("output_attentions", False)])
def test_refused_keyword_at_its_plain_value_computes(name, plain):
    assert torch.equal(_call(**{name: plain}), _call())


def test_unknown_keyword_is_refused_even_when_none():
    with pytest.raises(NotImplementedError, match="does not know the keyword future_option=None"):
        _call(future_option=None)


def test_sinks_are_computed():
    """GPT-OSS's `s_aux` (and `sinks`) are the learnable sinks of `ringlse.sinks`, not dropped."""
    q, k, v = _qkv()
    s = torch.randn(4, dtype=torch.float64)
    for name in ("s_aux", "sinks"):
        got = _call(**{name: s})
        want = ringlse.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                 softmax_scale=0.3, sinks=s)
        assert torch.equal(got, want) and not torch.equal(got, _call())


def test_softcap_is_computed():
    """Gemma 2's `softcap` keyword caps the scores: the attention function equals ringlse's own."""
    q, k, v = _qkv()
    out = rt.attention_forward(_Module(), q, k, v, None, scaling=0.3, softcap=0.5)[0]
    want = ringlse.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, softmax_scale=0.3, softcap=0.5)
    assert torch.equal(out, want)
    assert not torch.equal(out, _call())


def test_v_head_dim_other_than_qk_is_computed():
    q, k, v = _qkv(dv=6)
    out = rt.attention_forward(_Module(), q, k, v, None)[0]
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    assert out.shape == (1, 11, 4, 6)
    torch.testing.assert_close(out, want.transpose(1, 2))


def test_flash_packing_keywords_are_documents():
    """`cu_seq_lens_q/k` (DataCollatorWithFlattening's) are computed as documents, equal to position
    restarts; keywords that disagree raise."""
    bounds = torch.tensor([0, 4, 5, 11])
    pos = torch.cat([torch.arange(4), torch.arange(1), torch.arange(6)])[None]
    by_positions = _call(position_ids=pos)
    assert not torch.equal(by_positions, _call())
    assert torch.equal(_call(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=6, max_length_k=6), by_positions)
    assert torch.equal(_call(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, position_ids=pos), by_positions)
    with pytest.raises(NotImplementedError, match="cu_seq_lens_q and cu_seq_lens_k differ"):
        _call(cu_seq_lens_q=bounds, cu_seq_lens_k=torch.tensor([0, 11]))
    with pytest.raises(ValueError, match="disagree"):
        _call(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, position_ids=torch.cat([torch.arange(6), torch.arange(5)])[None])


# ---- the mask hook -------------------------------------------------------------------------------

masking = pytest.importorskip("transformers.masking_utils")


@pytest.mark.parametrize("mask", ["causal", "sliding", "packed", "padding"])
def test_mask_hook_takes_the_masks_the_attention_applies(mask):
    fn = {"causal": masking.causal_mask_function,
          "sliding": masking.sliding_window_causal_mask_function(4),
          "packed": masking.and_masks(masking.remap_positions_for_packed_sequence(
              masking.causal_mask_function, torch.arange(8)[None]),
              masking.packed_sequence_mask_function(torch.zeros(1, 8, dtype=torch.long))),
          "padding": masking.and_masks(masking.causal_mask_function,
                                       masking.padding_mask_function(torch.ones(1, 8, dtype=torch.bool)))}[mask]
    assert rt._no_mask(1, 8, 8, mask_function=fn) is None


@pytest.mark.parametrize("mask", ["chunked", "blockwise", "bidirectional-window", "custom"])
def test_mask_hook_refuses_masks_the_attention_does_not_apply(mask):
    fn = {"chunked": masking.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)),
          "blockwise": masking.or_masks(masking.causal_mask_function,
                                        masking.blockwise_overlay(torch.zeros(1, 8, dtype=torch.long))),
          "bidirectional-window": masking.sliding_window_bidirectional_mask_function(3),
          "custom": lambda b, h, q, k: k <= q}[mask]
    with pytest.raises(NotImplementedError, match="cannot apply the model's mask"):
        rt._no_mask(1, 8, 8, mask_function=fn)


def test_mask_hook_refuses_queries_that_do_not_end_the_keys():
    """A static cache holds more key slots than tokens: the queries do not sit at the end of the keys."""
    assert rt._no_mask(1, 1, 9, q_offset=8, mask_function=masking.causal_mask_function) is None  # dynamic cache
    with pytest.raises(NotImplementedError, match="aligns queries to the end of the keys"):
        rt._no_mask(1, 1, 32, q_offset=8, mask_function=masking.causal_mask_function)


# ---- refusals happen on every rank of a ring, before any K/V moves -------------------------------

@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"W{w}")
def test_refusals_raise_on_every_rank(world, tmp_path):
    per_rank = run_ranks(tw.refused_in_ring, world, tmp_path, timeout=120)
    for rank, messages in enumerate(per_rank):
        assert messages["s_aux"] == "no error", (rank, messages)  # computed (ringlse.sinks)
        assert messages["softcap"] == "no error", (rank, messages)  # computed in the ring
        assert messages["mla"] == "no error", (rank, messages)  # computed in the ring
        assert messages["after"] == "ok", (rank, messages)
