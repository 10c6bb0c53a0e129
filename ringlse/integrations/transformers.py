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
model's own extra mask functions (image tokens and the like).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringlse import library
from ringlse.attention import attention
from ringlse.ring import ring_attention, shard
from ringlse.ring.plan import default_layout

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


# The `ring()` contexts entered and not yet left, innermost last: read by the attention function at
# each call (a plain list, so torch.compile guards on it instead of breaking the graph).
_ACTIVE: list[_Ring] = []


@contextmanager
def ring(group: dist.ProcessGroup | None = None, layout: str | None = None,
         cu_seqlens: Sequence[int] | None = None, backend: str = "auto") -> Iterator[None]:
    """Inside, every "ringlse" attention call runs `ring_attention` over `group` on this rank's shard.

    Args:
        group: process group (default: the world; without torch.distributed, one rank).
        layout: how the sequence was sharded (`prepare_batch`'s): default `zigzag` for causal models.
        cu_seqlens: document boundaries over the global sequence (`RingBatch.cu_seqlens`), or None.
        backend: the block op, as in `ring_attention`.
    """
    bounds = None if cu_seqlens is None else torch.as_tensor(cu_seqlens, dtype=torch.int64, device="cpu")
    entry = _Ring(group, library.group_name(group), layout or default_layout(True), bounds, backend)
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


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, is_causal: bool | None = None,
                      position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: `query` `[b, h, s, d]`, `key`/`value`
    `[b, h_kv, s, d]` -> (`[b, s, h, d]`, no weights)."""
    if dropout:
        raise ValueError("ringlse attention has no dropout: set the config's attention_dropout to 0")
    _check_mask(attention_mask)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = _window(sliding_window, causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if not _ACTIVE:
        if torch.compiler.is_compiling():
            docs = None
            if position_ids is not None:  # restarts need cu_seqlens under compile: say so at run time
                torch._assert_async((position_ids[..., 1:] != 0).all(),
                                    "ringlse: packed position_ids under torch.compile need "
                                    "ringlse.integrations.transformers.ring(cu_seqlens=...)")
        else:
            docs = _documents(position_ids, q.shape[1])
        return attention(q, k, v, causal=causal, softmax_scale=scaling, window_size=window, cu_seqlens=docs), None
    r = _ACTIVE[-1]
    if torch.compiler.is_compiling():
        out, _ = library.ring_op(q, k, v, causal=causal, softmax_scale=scaling, group=r.group_name,
                                 layout=r.layout, window_size=window, cu_seqlens=r.cu_seqlens, backend=r.backend,
                                 timeout=None)
        return out, None
    if r.cu_seqlens is None and position_ids is not None and bool((position_ids[..., 1:] == 0).any()):
        raise ValueError("ringlse ring attention: position_ids restart inside this rank's shard, but ring() "
                         "got no cu_seqlens: pass prepare_batch(...).cu_seqlens")
    out = ring_attention(q, k, v, causal=causal, softmax_scale=scaling, group=r.group, layout=r.layout,
                         window_size=window, cu_seqlens=r.cu_seqlens, backend=r.backend)
    return out, None


def _no_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function=None, attention_mask: torch.Tensor | None = None, use_vmap: bool = False, **kwargs) -> None:
    """transformers' mask hook for "ringlse": no dense mask is ever built (the attention applies causal,
    window and documents itself); a padding mask or a model's own mask functions, which it cannot
    honour, raise instead of being dropped."""
    if use_vmap:  # transformers sets it when a model adds its own mask functions (or_/and_mask_function)
        raise ValueError("ringlse attention cannot apply a model's custom mask functions; use another "
                         "attn_implementation for this model")
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
                  layout: str | None = None, ignore_index: int = -100) -> RingBatch:
    """Shift, then shard, a global batch for the ring (every rank passes the same global tensors).

    Labels are shifted *before* sharding (token t's label is token t + 1, which may sit on another
    rank), as in `whole_batch`, whose arguments these are; then ids, labels and positions are sharded.

    Args:
        input_ids, labels, position_ids, ignore_index: as in `whole_batch` (`[b, S]`, S divisible as
            `layout` needs over the group's W ranks).
        group, layout: the ring's (default layout: zigzag).

    Returns:
        A `RingBatch` with this rank's `input_ids`, `labels`, `position_ids` (`[b, S / W]`), the global
        `cu_seqlens` and the global token count.
    """
    whole = whole_batch(input_ids, labels, position_ids, ignore_index=ignore_index)
    layout = layout or default_layout(True)
    part = lambda t: shard(t, layout, dim=1, group=group)
    return RingBatch(part(whole.input_ids), part(whole.labels), part(whole.position_ids), whole.cu_seqlens,
                     whole.num_tokens, ignore_index)


def ring_loss(logits: torch.Tensor, batch: RingBatch) -> torch.Tensor:
    """This rank's share of the global mean cross-entropy: its summed token losses over the global
    token count, so the ranks' losses (and their gradients) *sum* to the whole batch's mean. (A
    data-parallel wrapper that averages gradients over these ranks needs them scaled by W.)"""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=batch.ignore_index,
                           reduction="sum")
    return loss / max(batch.num_tokens, 1)

