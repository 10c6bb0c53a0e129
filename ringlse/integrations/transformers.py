"""ringlse as a transformers attention implementation (`attn_implementation="ringlse"`).

Through transformers' public `AttentionInterface` (no patching of private functions):

    from ringlse.integrations import transformers as rt
    rt.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ringlse")
    batch = rt.prepare_batch(input_ids, group=group)                 # this rank's shard, global positions
    with rt.ring(group=group, cu_seqlens=batch.cu_seqlens):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    rt.ring_loss(logits, batch).backward()                           # gradients: sum them over the ranks

Outside `ring()`, the same model runs single-device `ringlse.attention`. Documents: inside `ring()`
(and under torch.compile) from `cu_seqlens` over the *global* sequence, which `prepare_batch` derives
from position ids that restart at 0; outside it, in eager mode, from the position ids transformers
passes to attention (restarts at 0 begin a document, as transformers' own packed-sequence detection).
Windows: a model's `sliding_window` (transformers' convention: `sliding_window` keys up to and
including the query) becomes `window_size=(sliding_window - 1, 0)`.

With transformers >= 4.53 (`masking_utils`) `register()` also registers a mask hook that builds no
mask, so nothing O(S^2) is allocated. A padding mask cannot be honoured by a ring of packed
sequences: a 2-D mask with a padded position raises ValueError (packing is the way), and so do a
model's own extra mask functions (image tokens, chunked attention and the like) and queries that do
not end the keys (a static cache).

Never silently wrong: every keyword transformers passes to the attention function is computed
(scaling, is_causal, sliding_window, position_ids, cu_seq_lens_q/k, softcap: Gemma 2's logit
softcapping, s_aux / sinks: GPT-OSS's attention sinks), ignored on purpose because it carries no
attention math (`IGNORED_KEYWORDS`, each with its reason), or refused with an error naming the model
feature: dropout, position biases, sparse indices, attention weights, and any keyword this module does
not know. A V head dim other than Q/K's (DeepSeek-style MLA) is computed, single-device and inside
`ring()`. Every rank runs the same model, so every rank raises, before any K/V moves.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringlse.attention import attention
from ringlse.ring import ring_attention, shard
from ringlse.ring.layout import BALANCED, default_layout
from ringlse.specs import group_name

NAME = "ringlse"


@dataclass(frozen=True)
class _Ring:
    group: dist.ProcessGroup | None
    group_name: str
    layout: str
    # a CPU tensor, not a tuple: under torch.compile a tensor is a graph input, so batches with other
    # documents reuse the graph (a tuple would be a constant, one recompilation per batch)
    cu_seqlens: torch.Tensor | None
    backend: str
    head_group: dist.ProcessGroup | None = None


# The `ring()` contexts entered and not yet left, innermost last: read by the attention function at
# each call (a plain list, so torch.compile guards on it instead of breaking the graph).
_ACTIVE: list[_Ring] = []


@contextmanager
def ring(group: dist.ProcessGroup | None = None, layout: str | None = None,
         cu_seqlens: Sequence[int] | None = None, backend: str = "auto",
         head_group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Inside, every "ringlse" attention call runs `ring_attention` over `group` on this rank's shard.

    Args:
        group: process group (default: the world; without torch.distributed, one rank).
        layout: how the sequence was sharded (`prepare_batch`'s): default `zigzag` for causal models.
        cu_seqlens: document boundaries over the global sequence (`RingBatch.cu_seqlens`), or None
            (one document; `balanced` needs them).
        backend: the block op, as in `ring_attention`.
        head_group: head parallelism x ring, as in `ring_attention` (the batch sharded by
            `prepare_batch(..., head_group=)`); under torch.compile its all-to-alls are graph breaks
            around the ring's one op.
    """
    bounds = None if cu_seqlens is None else torch.as_tensor(cu_seqlens, dtype=torch.int64, device="cpu")
    entry = _Ring(group, group_name(group), layout or default_layout(True), bounds, backend, head_group)
    _ACTIVE.append(entry)
    try:
        yield
    finally:
        _ACTIVE.remove(entry)


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    if not sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _check_mask(attention_mask: torch.Tensor | None) -> None:
    """A mask that only says 'nothing is padded' is dropped; any other mask raises (it cannot be
    honoured: ringlse masks by causality, windows and documents, never by a dense tensor)."""
    if attention_mask is None:
        return
    if attention_mask.dim() == 2 and not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return
    raise ValueError("ringlse attention takes no attention_mask (padding or a prepared 4-D mask): pack the "
                     "sequences and pass position ids that restart at 0 per document (or cu_seqlens to "
                     "ringlse.integrations.transformers.ring), and call the model with attention_mask=None")


def _documents(position_ids: torch.Tensor | None, n: int) -> list[int] | None:
    """Document boundaries where `position_ids` (`[b, n]`, every row the same) restart at 0."""
    if position_ids is None:
        return None
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    if rows.shape[0] > 1 and not bool((rows == rows[:1]).all()):
        raise ValueError("ringlse attention: packed position_ids must be the same for every batch row")
    starts = torch.nonzero(rows[0, 1:] == 0).flatten().add(1).tolist()
    return [0, *starts, n] if starts else None


# Keywords transformers passes to attention functions that carry no attention math for ringlse, each
# with the reason it may be ignored. Every other keyword either is computed below or raises.
IGNORED_KEYWORDS: dict[str, str] = {
    "use_cache": "the cache is updated before the attention function is called",
    "cache_position": "where the new tokens sit in the cache; the mask hook checks they end the keys",
    "max_length_q": "a kernel sizing hint implied by cu_seq_lens_q",
    "max_length_k": "a kernel sizing hint implied by cu_seq_lens_k",
    "deterministic": "FlashAttention's deterministic-backward switch; ringlse's backward is deterministic",
    "output_hidden_states": "a switch of the model's outputs",
    "output_router_logits": "a switch of the model's outputs",
    "num_items_in_batch": "the loss's normalisation",
    "return_dict": "a switch of the model's outputs",
}

# Keywords that change the math, refused (with the model feature they stand for) unless they hold the
# value that leaves attention plain.
_REFUSED_KEYWORDS: dict[str, str] = {
    "position_bias": "an additive position bias (T5-style relative attention)",
    "head_mask": "a per-head mask",
    "indices": "sparse attention over selected keys (DeepSeek-V3.2-style indexer)",
    "topk_indices": "sparse attention over selected keys",
    "prev_topk_indices": "sparse attention over selected keys",
    "block_indices": "block-sparse attention",
    "seq_idx": "per-token sequence indices (pass documents as position_ids or cu_seqlens)",
}


# Keywords computed by `attention_forward` besides its named parameters (documents, flash-attn style).
_COMPUTED_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "softcap", "s_aux", "sinks")


def _check_keywords(kwargs: dict) -> None:
    """Raise for a keyword ringlse would otherwise drop while it changes the result (see the module
    docstring); the same on every rank, since every rank runs the same model."""
    for name, value in kwargs.items():
        if name in IGNORED_KEYWORDS or name in _COMPUTED_KEYWORDS:
            continue
        if name in _REFUSED_KEYWORDS:
            if value is None:  # the value that leaves attention plain
                continue
            raise NotImplementedError(f"ringlse attention does not compute {_REFUSED_KEYWORDS[name]}: the model "
                                      f"passes {name}={_describe(value)}; use another attn_implementation")
        if name == "output_attentions":
            if value:
                raise NotImplementedError("ringlse attention returns no attention weights (output_attentions=True); "
                                          "call the model with output_attentions=False")
            continue
        raise NotImplementedError(f"ringlse attention does not know the keyword {name}={_describe(value)} that "
                                  "the model passes to its attention function, so it cannot tell whether it "
                                  "changes the result; use another attn_implementation")


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    return repr(value)


def _flash_documents(kwargs: dict, position_docs: list[int] | None, n: int, batch: int) -> list[int] | None:
    """Documents from flash-attn's packed keywords (`cu_seq_lens_q/k`, DataCollatorWithFlattening's),
    which must agree with each other and with position restarts."""
    cq, ck = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cq is None and ck is None:
        return position_docs
    if cq is None or ck is None or not torch.equal(torch.as_tensor(cq).cpu(), torch.as_tensor(ck).cpu()):
        raise NotImplementedError("ringlse attention: cu_seq_lens_q and cu_seq_lens_k differ (queries and keys "
                                  "packed differently); only self-attention over one packing is computed")
    docs = [int(x) for x in torch.as_tensor(cq).tolist()]
    if batch != 1 or docs[-1] != n:
        raise ValueError(f"ringlse attention: cu_seq_lens_q {docs} must cover the one packed row of {n} tokens "
                         f"(batch {batch})")
    if position_docs is not None and position_docs != docs:
        raise ValueError(f"ringlse attention: cu_seq_lens_q {docs} and the position_ids' restarts "
                         f"{position_docs} disagree")
    return docs


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, is_causal: bool | None = None,
                      position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query` `[b, h, s, d]`, `key`/`value`
    `[b, h_kv, s, d]` -> (`[b, s, h, d]`, no weights). Keywords it does not compute raise (see
    `IGNORED_KEYWORDS` for the few it ignores on purpose)."""
    _check_keywords(kwargs)
    if dropout:
        raise ValueError("ringlse attention has no dropout: set the config's attention_dropout to 0")
    softcap = float(kwargs.get("softcap") or 0.0)  # Gemma 2 passes None when its config has none
    _check_mask(attention_mask)
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # GPT-OSS's learnable sink per head
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = _window(sliding_window, causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    packed = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    if not _ACTIVE:
        if torch.compiler.is_compiling():
            if packed:
                raise NotImplementedError("ringlse attention: cu_seq_lens_q/k under torch.compile need "
                                          "ringlse.integrations.transformers.ring(cu_seqlens=...)")
            docs = None
            if position_ids is not None:  # restarts need cu_seqlens under compile: say so at run time
                torch._assert_async((position_ids[..., 1:] != 0).all(),
                                    "ringlse: packed position_ids under torch.compile need "
                                    "ringlse.integrations.transformers.ring(cu_seqlens=...)")
        else:
            docs = _flash_documents(kwargs, _documents(position_ids, q.shape[1]), q.shape[1], q.shape[0])
        return attention(q, k, v, causal=causal, softmax_scale=scaling, window_size=window, cu_seqlens=docs,
                         sinks=sinks, softcap=softcap), None
    if packed:
        raise NotImplementedError("ringlse ring attention: cu_seq_lens_q/k describe this rank's shard, not the "
                                  "global sequence: pass prepare_batch(...).cu_seqlens to ring() instead")
    r = _ACTIVE[-1]
    if r.cu_seqlens is None and position_ids is not None and not torch.compiler.is_compiling() \
            and bool((position_ids[..., 1:] == 0).any()):
        raise ValueError("ringlse ring attention: position_ids restart inside this rank's shard, but ring() "
                         "got no cu_seqlens: pass prepare_batch(...).cu_seqlens")
    out = ring_attention(q, k, v, causal=causal, softmax_scale=scaling, group=r.group_name, layout=r.layout,
                         window_size=window, cu_seqlens=r.cu_seqlens, backend=r.backend, sinks=sinks,
                         softcap=softcap, head_group=r.head_group)
    return out, None


# transformers' mask functions (masking_utils) whose rule the attention applies itself: causal or not
# from the module, windows from `sliding_window`, documents from position ids or cu_seqlens, padding
# from attention_mask (checked there); and the wrappers that only compose or re-index them.
_PLAIN_MASKS = ("causal_mask_function", "bidirectional_mask_function", "sliding_window_overlay.<locals>.inner_mask",
                "packed_sequence_mask_function.<locals>.inner_mask", "padding_mask_function.<locals>.inner_mask")
_MASK_WRAPPERS = {"and_masks.<locals>.and_mask": "mask_functions",
                  "remap_positions_for_packed_sequence.<locals>.inner_mask": "mask_function",
                  "add_offsets_to_mask_function.<locals>.inner_mask": "mask_function"}


def _unknown_masks(mask_function) -> list[str]:
    """The parts of a transformers mask function that the attention does not apply (chunked or
    block-wise attention, bidirectional windows, a model's own functions), by name."""
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    if name in _PLAIN_MASKS:
        return []
    if name not in _MASK_WRAPPERS:
        return [name]
    inner = inspect.getclosurevars(mask_function).nonlocals.get(_MASK_WRAPPERS[name])
    inner = inner if isinstance(inner, tuple) else (inner,)
    return [part for fn in inner for part in _unknown_masks(fn)]


def _no_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function=None, attention_mask: torch.Tensor | None = None, use_vmap: bool = False, **kwargs) -> None:
    """transformers' mask hook for "ringlse": no dense mask is ever built (the attention applies causal,
    window and documents itself); a padding mask, a model's own mask functions, or queries that do
    not end the keys (a static cache), none of which it can honour, raise instead of being dropped."""
    if use_vmap:  # transformers sets it when a model adds its own mask functions (or_/and_mask_function)
        raise ValueError("ringlse attention cannot apply a model's custom mask functions; use another "
                         "attn_implementation for this model")
    if not torch.compiler.is_compiling():  # the mask functions are the same traced or not
        unknown = _unknown_masks(mask_function) if mask_function is not None else []
        if unknown:
            raise NotImplementedError(f"ringlse attention cannot apply the model's mask {', '.join(unknown)} (it "
                                      "applies causal masks, sliding windows and packed documents); use another "
                                      "attn_implementation for this model")
    if q_offset - kv_offset != kv_length - q_length:
        raise NotImplementedError(f"ringlse attention aligns queries to the end of the keys; this call's {q_length} "
                                  f"queries start at {q_offset} over {kv_length} keys from {kv_offset} (a static or "
                                  "sliding cache): use a dynamic cache or another attn_implementation")
    if attention_mask is not None:
        if torch.compiler.is_compiling():
            torch._assert_async(attention_mask.all(), "ringlse attention: padded positions in attention_mask")
        else:
            _check_mask(attention_mask)
    return None


def register() -> None:
    """Register the attention implementation "ringlse" with transformers (>= 4.48), and, where
    transformers has a mask registry (>= 4.53), its mask hook (no dense mask; padding raises)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention_forward)
    try:
        from transformers import AttentionMaskInterface
    except ImportError:  # older transformers build a dense causal mask, which the attention ignores
        return
    AttentionMaskInterface.register(NAME, _no_mask)


@dataclass(frozen=True)
class RingBatch:
    """This rank's part of a global batch (`prepare_batch`)."""

    input_ids: torch.Tensor  # [b, n] this rank's tokens
    labels: torch.Tensor  # [b, n] the next token of each (shifted before sharding), ignore_index where none
    position_ids: torch.Tensor  # [b, n] global positions within each document
    cu_seqlens: tuple[int, ...] | None  # document boundaries over the global sequence (None: one document)
    num_tokens: int  # labels != ignore_index over the whole global batch (the loss's denominator)
    ignore_index: int


def whole_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, ignore_index: int = -100) -> RingBatch:
    """The batch `prepare_batch` shards, unsharded (a single-process run of the same loss).

    Labels are shifted (token t's label is token t + 1); the last token of every document gets
    `ignore_index` (its next token belongs to the next document). Documents begin where
    `position_ids` restart at 0 (one document when None).

    Args:
        input_ids: `[b, S]` token ids.
        labels: `[b, S]` targets before shifting (default: `input_ids`).
        position_ids: `[b, S]` or `[S]` positions restarting at 0 per document (default: `arange(S)`);
            every row the same.
        ignore_index: the label that contributes no loss.

    Returns:
        A `RingBatch` over the whole sequence.
    """
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device) if position_ids is None else position_ids
    positions = positions.reshape(-1, s).expand(b, s).contiguous()
    docs = _documents(positions, s)
    labels = input_ids if labels is None else labels
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    for end in (docs or [0, s])[1:]:
        shifted[:, end - 1] = ignore_index
    return RingBatch(input_ids, shifted, positions, None if docs is None else tuple(docs),
                     int((shifted != ignore_index).sum()), ignore_index)


def prepare_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None, *, group: dist.ProcessGroup | None = None,
                  layout: str | None = None, ignore_index: int = -100,
                  head_group: dist.ProcessGroup | None = None) -> RingBatch:
    """Shift, then shard, a global batch for the ring (every rank passes the same global tensors).

    Labels are shifted *before* sharding (token t's label is token t + 1, which may sit on another
    rank), as in `whole_batch`, whose arguments these are; then ids, labels and positions are sharded.

    Args:
        input_ids, labels, position_ids, ignore_index: as in `whole_batch` (`[b, S]`, S divisible as
            `layout` needs over the group's W ranks).
        group, layout: the ring's (default layout: zigzag; `balanced` places tokens by the documents
            of `position_ids`, CONVENTIONS.md §5).
        head_group: head parallelism x ring: each ring part is cut into the head group's U pieces
            (`ringlse.shard(..., head_group=)`), so this rank's tensors are `[b, S / (W·U)]`.

    Returns:
        A `RingBatch` with this rank's `input_ids`, `labels`, `position_ids` (`[b, S / W]`), the global
        `cu_seqlens` (with `balanced`, `(0, S)` for a batch of one document: the layout needs them)
        and the global token count.
    """
    whole = whole_batch(input_ids, labels, position_ids, ignore_index=ignore_index)
    layout = layout or default_layout(True)
    docs = whole.cu_seqlens
    if layout == BALANCED and docs is None:
        docs = (0, input_ids.shape[1])
    part = lambda t: shard(t, layout, dim=1, group=group, cu_seqlens=docs, head_group=head_group)
    return RingBatch(part(whole.input_ids), part(whole.labels), part(whole.position_ids), docs,
                     whole.num_tokens, ignore_index)


def ring_loss(logits: torch.Tensor, batch: RingBatch) -> torch.Tensor:
    """This rank's share of the global mean cross-entropy: its summed token losses over the global
    token count, so the ranks' losses (and their gradients) *sum* to the whole batch's mean. (A
    data-parallel wrapper that averages gradients over these ranks needs them scaled by W.)"""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=batch.ignore_index,
                           reduction="sum")
    return loss / max(batch.num_tokens, 1)

