"""Host side: any tensor as `R` rows of `N` columns, without a copy where its dims allow.

The reduced dim is moved last by a view, and the other dims are folded into at most two (outer, inner)
groups with their own strides, so `dim != -1` costs no copy (only layouts that fold into more than two
groups are copied). Row `r` = `o * I + i` starts at `o * s_o + i * s_i`; column `n` is `n * s_n` further.
"""

from __future__ import annotations

import torch


def layout(t: torch.Tensor | None) -> tuple | None:
    """What a call plan may depend on of a tensor (None for no tensor)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def fold_rows(t: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """`t` `[..., N]` as rows: `(O, I, s_o, s_i, s_n)` such that row `r = o * I + i` (row-major order
    of the leading dims) starts at element `o * s_o + i * s_i`; None if the leading dims do not fold into
    two strided groups (then the caller copies)."""
    shape, strides = t.shape, t.stride()
    if len(shape) <= 2:  # the common case without the loop below (same result: a size-1 dim is dropped)
        if len(shape) == 1 or shape[0] == 1:
            return 1, 1, 0, 0, strides[-1]
        return shape[0], 1, strides[0], 0, strides[1]
    groups: list[list[int]] = []
    for size, stride in zip(shape[:-1], strides[:-1]):
        if size == 1:
            continue
        if groups and groups[-1][1] == stride * size:
            groups[-1] = [groups[-1][0] * size, stride]
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        return None
    while len(groups) < 2:
        groups.append([1, 0])  # pad on the inside: I = 1 is specialised away by Triton
    (o, s_o), (i, s_i) = groups
    return o, i, s_o, s_i, strides[-1]


def dim_last(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t.movedim(dim, -1)` for `dim >= 0`, skipping the view (~2 us of host time) when it is already last."""
    return t if dim == t.dim() - 1 else t.movedim(dim, -1)


def input_rows(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, int, int, int, int], bool]:
    """Plan time: `t` with `dim` (>= 0) moved last (a view where its dims fold, else a copy), its row
    folding, and whether it was copied (`input_view` does the same per call)."""
    tm = dim_last(t, dim)
    lay = fold_rows(tm)
    if lay is not None:
        return tm, lay, False
    tm = tm.contiguous()
    return tm, fold_rows(tm), True


def input_view(t: torch.Tensor, dim: int, copy: bool) -> torch.Tensor:
    """Per call: the row view `input_rows` planned for tensors of `t`'s layout."""
    tm = dim_last(t, dim)
    return tm.contiguous() if copy else tm


def output_rows(
    out: torch.Tensor | None, like: torch.Tensor, dim: int, shape: torch.Size, dtype: torch.dtype, what: str
) -> tuple[torch.Tensor, tuple[int, int, int, int, int], bool, bool]:
    """Plan time: row view of the output and its folding, then `direct` (the caller's `out` is written
    in place: its layout folds) and `dense` (a fresh buffer keeps the memory order of the row view
    `like`: its layout folds), which `output_view` takes per call. A fresh buffer is written where
    `out` does not fold, and copied into it at the end."""
    if out is not None:
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != like.device:
            raise ValueError(f"{what}: out must be {tuple(shape)} {dtype} on {like.device}, got {tuple(out.shape)} "
                             f"{out.dtype} on {out.device}")
        om = dim_last(out, dim)
        lay = fold_rows(om)
        if lay is not None:
            return om, lay, True, True
    ym = torch.empty_like(like, dtype=dtype)
    lay = fold_rows(ym)
    if lay is not None:
        return ym, lay, False, True
    ym = torch.empty(like.shape, dtype=dtype, device=like.device)
    return ym, fold_rows(ym), False, False


def output_view(out: torch.Tensor | None, like: torch.Tensor, dim: int, dtype: torch.dtype, direct: bool,
                dense: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per call: the output rows `output_rows` planned, and the `out` to copy them into at the end
    (`finish`; None: written in place or no `out`)."""
    if direct:
        return dim_last(out, dim), None
    if dense:
        return torch.empty_like(like, dtype=dtype), out
    return torch.empty(like.shape, dtype=dtype, device=like.device), out


def finish(ym: torch.Tensor, dim: int, target: torch.Tensor | None) -> torch.Tensor:
    """The output rows `ym` with the reduced dim put back, copied into `target` where there is one."""
    y = ym if dim == ym.dim() - 1 else ym.movedim(-1, dim)
    return y if target is None else target.copy_(y)


def col64(n: int, *strides: int) -> bool:
    """Whether column offsets of rows of `n` columns with these strides could overflow int32."""
    return max((1, *map(abs, strides))) * n >= 2**31


def aligned_rows(ts: tuple[torch.Tensor, ...], N: int, strides: tuple[tuple[int, int, int], ...]) -> bool:
    """Whether the rows of `ts` (with their (outer, inner, column) strides) can be read in whole 16-byte
    vectors, their ends apart (`vectors.py`), and need to: they start or end off 16-byte boundaries,
    and their columns are contiguous, their base pointers 16-byte aligned and the rows of every tensor
    at the offsets from the boundaries of the first's."""
    if any(st[2] != 1 for st in strides):
        return False
    if any(t.data_ptr() % 16 for t in ts):
        return False
    vec = 16 // ts[0].element_size()  # elements in 16 bytes
    if any((a - b) % vec for st in strides[1:] for a, b in zip(st[:2], strides[0][:2])):
        return False
    # every row on a boundary: the plain kernels load as wide, with less arithmetic
    return not (strides[0][0] % vec == 0 and strides[0][1] % vec == 0 and N % vec == 0)


def pair_pack(xm: torch.Tensor, ym: torch.Tensor, N: int, row_strides: tuple, col_strides: tuple) -> int:
    """PACK for the cooperative forward: 1 (bf16) or 2 (fp16) where x and y can be read and written as
    int32 words of two elements (contiguous rows of even length, even row strides, 4-byte aligned),
    else 0."""
    if xm.dtype not in (torch.bfloat16, torch.float16) or N % 2:
        return 0
    if any(s != 1 for s in col_strides) or any(s % 2 for s in row_strides):
        return 0
    if xm.data_ptr() % 4 or ym.data_ptr() % 4:
        return 0
    return 1 if xm.dtype == torch.bfloat16 else 2
