"""The options of one attention call as a frozen object: `AttentionSpec` (single device: `attention`,
`block_attention`, `chunked_attention`, `varlen_attention`) and `RingSpec` (`ring_attention`).

A spec is built once by the public function, from its keyword arguments, and carried whole through the
one autograd path (`ringlse.ops`) into the plan builders; `op_args()` flattens it into the arguments of
the `torch.library` custom ops (ints, floats, strings, optional tensors: what an op schema takes), and
`from_op_args` rebuilds it inside the op. Only what an op schema needs is normalised here (types,
boundaries as a tensor, a `BlockOp` as a registered name); every other check runs where the plan is
built, with the tensors at hand.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ringlse.blocks.contract import BlockOp
from ringlse.checks import check_flag, check_softcap
from ringlse.masks import check_window

# `BlockOp`s passed as `backend=` by callers, by the name the custom ops know them by (an op schema
# takes strings, not objects); held weakly, so an op a caller drops is not kept alive here.
_BLOCK_OPS: weakref.WeakValueDictionary[str, BlockOp] = weakref.WeakValueDictionary()


def backend_name(backend: str | BlockOp) -> str:
    """`backend` as an op argument: a registry name as it is, a `BlockOp` under a name of its own."""
    if isinstance(backend, BlockOp):
        name = f"<BlockOp {backend.name} {id(backend):x}>"
        _BLOCK_OPS[name] = backend
        return name
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name or a BlockOp, got {type(backend).__name__}")
    return backend


def backend_from_name(name: str) -> str | BlockOp:
    """The inverse of `backend_name`."""
    return _BLOCK_OPS.get(name, name)


def boundaries(cu_seqlens: Sequence[int] | torch.Tensor | None) -> torch.Tensor | None:
    """Document boundaries as an op argument: a tensor as given (under torch.compile a graph input, so
    new boundaries reuse the graph), a sequence as an int64 CPU tensor (its values are checked with
    the tensors' lengths, `ringlse.masks.check_docs`)."""
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens
    values = list(cu_seqlens)
    if any(isinstance(x, bool) or not isinstance(x, int) for x in values):
        raise ValueError(f"cu_seqlens must hold ints, got {cu_seqlens!r}")
    return torch.tensor(values, dtype=torch.int64)


class _Errors:
    """Collects what is wrong with a call's options instead of raising: the op raises it when it runs
    (under torch.compile a check that raised while tracing would stop the trace, not the call; in a
    ring every rank must reach the agreement before anyone raises)."""

    def __init__(self):
        self.messages: list[str] = []
        self.kind = "ValueError"

    def take(self, check, default):
        try:
            return check()
        except (TypeError, ValueError) as e:
            if not self.messages:
                self.kind = type(e).__name__
            self.messages.append(str(e))
            return default

    def text(self) -> str:
        return _encode(self.kind, "; ".join(self.messages)) if self.messages else ""


def _encode(kind: str, message: str) -> str:
    return f"{kind}: {message}"


def error_message(error: str) -> str:
    """The message of a spec's collected `error` (without its exception type)."""
    return error.partition(": ")[2]


def raise_error(error: str) -> None:
    """Raise a spec's collected `error` (`"TypeError: ..."` or `"ValueError: ..."`), if any."""
    if error:
        raise (TypeError if error.startswith("TypeError") else ValueError)(error_message(error))


def _check_int(value: object, name: str, what: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__}")


def _check_float(value: object, name: str, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: {name} must be a float, got {type(value).__name__}")
    return float(value)


@dataclass(frozen=True)
class AttentionSpec:
    """One single-device attention call's options (CONVENTIONS.md §4, §10). `q_start=None` aligns the
    queries to the end of the keys (bottom-right); `cu_seqlens_q` set means flash-attn's varlen layout
    (`cu_seqlens` then indexes the keys)."""

    what: str
    causal: bool = False
    softmax_scale: float | None = None
    q_start: int | None = 0
    k_start: int = 0
    window_size: tuple[int, int] = (-1, -1)
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    chunk_size: int | None = None
    backend: str = "auto"
    softcap: float = 0.0
    error: str = ""

    @classmethod
    def make(cls, what: str, *, causal, softmax_scale, q_start, k_start, window_size, cu_seqlens, backend,
             chunk_size=None, cu_seqlens_q=None, softcap=0.0) -> AttentionSpec:
        """The spec of a call to `what` with these keyword arguments; a malformed one is kept in `error`
        (raised by the op, `raise_error`). Its keywords are the public functions' options, one each.

        Its keywords are the public function's options, passed through as they are.
        """
        errors = _Errors()

        def check_starts():
            _check_int(q_start, "q_start", what, optional=True)
            _check_int(k_start, "k_start", what)
            return q_start, k_start

        starts = errors.take(check_starts, (0, 0))
        spec = cls(what, errors.take(lambda: check_flag(causal, "causal", what), False),
                   errors.take(lambda: _check_float(softmax_scale, "softmax_scale", what), None), *starts,
                   errors.take(lambda: check_window(window_size, what), (-1, -1)),
                   errors.take(lambda: boundaries(cu_seqlens), None), errors.take(lambda: boundaries(cu_seqlens_q), None),
                   chunk_size, errors.take(lambda: backend_name(backend), "auto"),
                   errors.take(lambda: check_softcap(softcap, what), 0.0))
        return replace(spec, error=errors.text())

    def op_args(self) -> tuple:
        """The custom op's arguments after q, k, v (`ringlse.ops`), in its schema's order."""
        return (self.cu_seqlens, self.cu_seqlens_q, self.causal, self.softmax_scale, self.q_start, self.k_start,
                list(self.window_size), self.chunk_size, self.backend, self.softcap, self.what, self.error)

    @classmethod
    def from_op_args(cls, cu_seqlens, cu_seqlens_q, causal, softmax_scale, q_start, k_start, window, chunk_size,
                     backend, softcap, what, error) -> AttentionSpec:
        """The spec back from the op's arguments (`op_args`' order: one parameter per op argument)."""
        return cls(what, causal, softmax_scale, q_start, k_start, tuple(window), cu_seqlens, cu_seqlens_q,
                   chunk_size, backend, softcap, error)


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name an op argument finds `group` by ("" for the default group)."""
    return "" if group is None else group.group_name


def group_from_name(name: str) -> dist.ProcessGroup | None:
    """The inverse of `group_name` (ValueError for a group this process does not have)."""
    if not name:
        return None
    for group, known in dist.distributed_c10d._world.pg_names.items():
        if known == name:
            return group
    raise ValueError(f"ring_attention: no process group named {name!r} in this process")


def timeout_seconds(timeout: datetime.timedelta | float | None) -> float | None:
    """`timeout=` as seconds for an op argument (checked by the ring's plan)."""
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if timeout is None or isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        return timeout
    return float(timeout)


@dataclass(frozen=True)
class RingSpec:
    """One `ring_attention` call's options; the group by its name (`group_name`). `error` holds why an
    option is malformed (its field then holds a default): the ring's plan raises it on every rank
    together, through the ranks' agreement, instead of this rank alone. `agree=False` skips that
    comparison (only for a fake process group, which cannot compare)."""

    causal: bool = False
    softmax_scale: float | None = None
    group: str = ""
    layout: str | None = None
    return_lse: bool = False
    window_size: tuple[int, int] = (-1, -1)
    cu_seqlens: torch.Tensor | None = None
    backend: str = "auto"
    timeout: float | None = None
    agree: bool = True
    softcap: float = 0.0
    error: str = ""
    # (this rank's rank in the head group, its size) for a head-parallel call, compared by the ranks'
    # agreement (`ringlse.ring.head_parallel`); (0, 1) without a head group
    head_split: tuple[int, int] = (0, 1)

    @classmethod
    def make(cls, *, causal, softmax_scale, group, layout, return_lse, window_size, cu_seqlens, backend, timeout,
             agree: bool = True, softcap=0.0) -> RingSpec:
        """The spec of a `ring_attention` call with these keyword arguments; a malformed option becomes
        `error` (every rank must reach the agreement, so nothing option-dependent raises here). Its
        keywords are `ring_attention`'s options, one each."""
        what, errors = "ring_attention", _Errors()
        take = errors.take

        def check_layout():
            if layout is not None and not isinstance(layout, str):
                raise ValueError(f"{what}: layout must be a name, got {layout!r}")
            return layout

        def check_timeout():
            if timeout is not None and not isinstance(timeout, datetime.timedelta) and (
                    isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
                raise ValueError(f"{what}: timeout must be seconds or a datetime.timedelta, got {timeout!r}")
            return timeout_seconds(timeout)

        name = group if isinstance(group, str) else group_name(group)
        spec = cls(take(lambda: check_flag(causal, "causal", what), False),
                   take(lambda: _check_float(softmax_scale, "softmax_scale", what), None), name,
                   take(check_layout, None), take(lambda: check_flag(return_lse, "return_lse", what), False),
                   take(lambda: check_window(window_size, what), (-1, -1)), take(lambda: boundaries(cu_seqlens), None),
                   take(lambda: backend_name(backend), "auto"), take(check_timeout, None), agree,
                   take(lambda: check_softcap(softcap, what), 0.0))
        return replace(spec, error=errors.text())

    def with_problem(self, message: str) -> RingSpec:
        """This spec with one more `ValueError` about the call (kept after any earlier one)."""
        return replace(self, error=self.error or _encode("ValueError", message))

    def op_args(self) -> tuple:
        """The custom op's arguments after q, k, v (`ringlse.ops`), in its schema's order."""
        return (self.cu_seqlens, self.causal, self.softmax_scale, self.group, self.layout or "", self.return_lse,
                list(self.window_size), self.backend, self.timeout, self.agree, self.softcap, self.error,
                list(self.head_split))

    @classmethod
    def from_op_args(cls, cu_seqlens, causal, softmax_scale, group, layout, return_lse, window, backend, timeout,
                     agree, softcap, error, head_split) -> RingSpec:
        """The spec back from the op's arguments (`op_args`' order: one parameter per op argument)."""
        return cls(causal, softmax_scale, group, layout or None, return_lse, tuple(window), cu_seqlens, backend,
                   timeout, agree, softcap, error, tuple(head_split))
