"""What the forward and backward attention kernels share: the key range of a query tile, the mask
offset, dot precision, the launch configs (tuning tables and the fallback when one does not fit) and
the argument checks.

Masking (CONVENTIONS.md §4): key `j` is visible to query `i` iff `k_start + j <= q_start + i`, i.e.
`j <= i + offset` with `offset = q_start - k_start`. The kernels take `offset` and a `CAUSAL` flag
only; which blocks to run, and which of them need the mask, the caller decides (see
`attention_forward`).

Interval masks (CONVENTIONS.md §10: causal x sliding window x packed documents at global positions):
any mask in which query row `i` of a block sees the keys `[key_lo[i], key_hi[i])` (local indices, empty
when `key_lo[i] >= key_hi[i]`). The kernels take the int32 bound vectors (never a dense mask) under an
`INTERVALS` constexpr, so the kernels without them compile to the same code as before they existed.
`interval_tile_range` splits a program's walk into masked tiles at both ends and unmasked ones in the
middle; the backward's dk/dv kernel uses it on the inverse intervals (the query rows that see a key).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ringlse.kernels.host import interpreting, next_power_of_2
from ringlse.kernels.merge_math import merge_shift

LOG2E = 1.4426950408889634


@triton.jit
def query_tile_key_range(m0, SK, OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key tiles of the query tile at row `m0`: `[0, n_full)` are visible to every row of the tile
    (no mask needed), `[n_full, n_hi)` are cut by the causal boundary or the key tail (masked), keys
    from `n_hi` on are visible to no row (never visited). An empty range where no row sees a key."""
    n_even = (SK // BLOCK_N) * BLOCK_N
    if CAUSAL:
        # the first row of this tile sees keys j <= m0 + OFFSET, the last j <= m0 + BLOCK_M - 1 + OFFSET
        n_hi = tl.maximum(tl.minimum(SK, m0 + BLOCK_M + OFFSET), 0)
        first_sees = m0 + OFFSET + 1
        n_full = tl.where(first_sees > 0, (first_sees // BLOCK_N) * BLOCK_N, 0)
        n_full = tl.minimum(n_full, n_even)
    else:
        n_hi = SK
        n_full = n_even
    return n_full, n_hi


@triton.jit
def tile_visible(offs_m, offs_n, n_ok, row_lo, row_hi, OFFSET, CAUSAL: tl.constexpr, INTERVALS: tl.constexpr):
    """`[M, N]` visibility of the keys `offs_n` to the query rows `offs_m` in a masked tile: with
    INTERVALS row `i` sees `[row_lo[i], row_hi[i])` (`row_hi <= SK`: the key tail is masked too),
    otherwise the keys with `n_ok` (`offs_n < SK`, the caller's load mask), cut by the causal rule with
    CAUSAL."""
    if INTERVALS:
        visible = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])
    else:
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
    return visible


@triton.jit
def softmax_step(qk, m_i, qk_scale, visible, MASKED: tl.constexpr, LAZY: tl.constexpr):
    """One key tile's online-softmax step in base 2 on the raw scores `qk` `[M, N]`: `(p, m_new, alpha)`,
    `alpha` the factor of the running sums. Masked tiles keep the `visible` pairs; unmasked ones need
    `qk_scale > 0` (the launchers make it so). LAZY keeps a row's max unless the tile's exceeds it by more
    than 8 (p <= 2**8: exact in float32, finite in bf16/fp16), so that `alpha` is exactly 1 for most rows
    and tiles and the caller may skip rescaling its accumulator where it is 1 for every row."""
    if MASKED:
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
    else:
        # every key here is visible, so m_new is finite, and scale > 0 gives max(qk) * scale ==
        # max(qk * scale): the scaling fuses into one FMA
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if LAZY:
        # (a row that has seen nothing keeps -inf: -inf > -inf + 8 is false)
        m_new = tl.where(m_new > m_i + 8.0, m_new, m_i)
    if MASKED:
        # a row that has seen no key yet keeps max -inf: subtract 0 instead so that exp2(-inf - -inf)
        # never makes a NaN (its p and alpha come out 0)
        m_sub = merge_shift(m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
    else:
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
    return p, m_new, alpha


@triton.jit
def tanh_f32(x, SOFTCAP: tl.constexpr):
    """`tanh(x)` in float32: SOFTCAP 2 takes the GPU's one-instruction approximation (relative error
    2**-11, below bf16/fp16 rounding of the scores), SOFTCAP 1 the exact form `1 - 2 / (e^2x + 1)` (a few
    ulps absolute, saturating to +-1; runs under the interpreter and keeps float32 inputs to §7's bound)."""
    if SOFTCAP == 2:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 - 2.0 / (tl.math.exp2(x * 2.885390081777927) + 1.0)


@triton.jit
def cap_scales(qk_scale, softcap):
    """`(into_tanh, cap_scale)`: raw dots times `into_tanh` (= scale / softcap) are tanh's arguments, and
    tanh times `cap_scale` (= softcap * log2(e)) is the capped score in base 2 (`qk_scale` = scale * log2(e))."""
    cap_scale = softcap * 1.4426950408889634  # (LOG2E: a jit function reads only constexpr globals)
    return qk_scale / cap_scale, cap_scale


@triton.jit
def softcap_scores(s, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """The capped scores of raw dots `s` as `(t, cap_scale)`: `t * cap_scale` is `softcap * tanh(scale * s /
    softcap)` in base 2 (`qk_scale` = scale * log2(e), `cap_scale` = softcap * log2(e)), the cap applied at
    natural scale (Gemma 2's and flash-attn's definition). Callers scale `t` by `cap_scale` where they scale uncapped dots by
    `qk_scale`, in the same FMA with the max or the lse (no multiply of its own)."""
    into_tanh, cap_scale = cap_scales(qk_scale, softcap)
    return tanh_f32(s * into_tanh, SOFTCAP), cap_scale


@triton.jit
def key_tile_query_range(n0, SQ, SK, OFFSET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Query tiles that see the key tile at key `n0` (the dk/dv kernels' walk): from `m_lo` on; those
    before `m_full` are cut by the causal boundary (masked), those from `m_full` on see every key of the
    tile (unmasked)."""
    if CAUSAL:
        # query i sees key j iff j <= i + OFFSET: rows before n0 - OFFSET see none of these keys;
        # rows from (last real key) - OFFSET on see all of them
        m_lo = (tl.maximum(n0 - OFFSET, 0) // BLOCK_M) * BLOCK_M
        last_unmasked = tl.minimum(n0 + BLOCK_N, SK) - 1 - OFFSET
        m_full = tl.where(last_unmasked > 0, tl.cdiv(last_unmasked, BLOCK_M) * BLOCK_M, 0)
        m_full = tl.minimum(tl.maximum(m_full, m_lo), SQ)
    else:
        m_lo = 0
        m_full = 0
    return m_lo, m_full


@triton.jit
def interval_tile_range(Lo, Hi, offs, ok, LIMIT, BLOCK: tl.constexpr):
    """The walk of a program whose rows `offs` (those with `ok`) see the columns `[Lo[r], Hi[r])` of
    `[0, LIMIT)` (forward and dq: query rows seeing keys; dk/dv: key rows seen by queries), over column
    tiles of `BLOCK`.

    Returns `(lo, hi, start, full_lo, full_hi, end)`: the rows' bounds clamped to `[0, LIMIT]` (rows
    without `ok` get `lo = hi = 0`), so that a row is live (sees something) iff `lo < hi`; column tiles
    `[start, full_lo)` and `[full_hi, end)` are masked (each row keeps `lo <= column < hi`), tiles
    `[full_lo, full_hi)` are seen whole by every live row (no mask), columns before `start` or from
    `end` on are seen by no live row (never visited; columns inside `[start, end)` that no row sees,
    a gap between the intervals of two rows, are visited masked). Only live rows count: rows with an
    empty interval may hold any bounds (they need not follow the others' order); the caller lets them
    ride along through the unmasked tiles and discards what they computed (`lo < hi`) at the end. No
    live row: every range is empty."""
    lo = tl.load(Lo + offs, mask=ok, other=0)
    hi = tl.load(Hi + offs, mask=ok, other=0)
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, LIMIT)
    live = ok & (lo < hi)
    lo_min = tl.min(tl.where(live, lo, LIMIT), 0)
    lo_max = tl.max(tl.where(live, lo, 0), 0)
    hi_min = tl.min(tl.where(live, hi, LIMIT), 0)
    end = tl.max(tl.where(live, hi, 0), 0)
    start = (lo_min // BLOCK) * BLOCK
    # tiles inside [max lo, min hi): every live row sees them whole (hi <= LIMIT keeps them in bounds)
    full_lo = tl.maximum(((lo_max + BLOCK - 1) // BLOCK) * BLOCK, start)
    full_hi = tl.minimum((hi_min // BLOCK) * BLOCK, end)
    has_full = full_lo < full_hi
    full_lo = tl.where(has_full, full_lo, start)
    full_hi = tl.where(has_full, full_hi, start)
    return lo, hi, start, full_lo, full_hi, end


def mask_offset(causal: bool, seqlen_q: int, seqlen_k: int, q_start: int, k_start: int) -> int:
    """The kernels' `OFFSET`: `q_start - k_start` clamped to `[-seqlen_q, seqlen_k]` (the same keys are
    visible to every row, and it stays a 32-bit integer whatever the global positions); 0 without
    `causal` (the kernels ignore it then, and one compiled kernel serves every position)."""
    if not causal:
        return 0
    return min(max(q_start - k_start, -seqlen_q), seqlen_k)


def softcap_mode(softcap: float, dtype: torch.dtype, what: str) -> int:
    """The kernels' SOFTCAP constexpr: 0 without a cap (compiled out: the uncapped kernels are unchanged),
    2 for bf16/fp16 on the GPU (approximate tanh), 1 otherwise (exact tanh: float32, the interpreter)."""
    cap = float(softcap)
    if not cap >= 0.0 or cap == float("inf"):
        raise ValueError(f"{what}: softcap must be a finite number >= 0 (0 turns it off), got {softcap}")
    if cap == 0.0:
        return 0
    return 2 if dtype != torch.float32 and not interpreting() else 1


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: 3-pass TF32 ("tf32x3", about float32 accuracy on the tensor cores; plain TF32
    missed CONVENTIONS.md §7's 1e-3 * max|ref| by 1.5-3x on H200). 16-bit inputs ignore it."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    """The padded head dim a kernel tile uses: a power of two >= 16 (dots need K >= 16)."""
    return max(16, next_power_of_2(head_dim))


# ---------------------------------------------------------------------------------------------------
# launch configs: candidates best first, timed on H200


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# configs chosen by timing on the GPU at hand (benchmarks/block_attention.py --sweep sets them):
# (block_d, dtype, causal) -> FwdConfig, tried before the built-in table
FWD_TUNED: dict[tuple[int, torch.dtype, bool], FwdConfig] = {}
# the config that compiled and ran for a (head_dim, dtype, causal, accum, device) key
FWD_CHOSEN: dict[tuple, FwdConfig] = {}


def set_tuned_fwd_config(head_dim: int, dtype: torch.dtype, causal: bool, config: FwdConfig) -> None:
    """Prefer `config` for this head dim/dtype/mask from now on (e.g. the winner of a sweep)."""
    FWD_TUNED[(block_d(head_dim), dtype, causal)] = config
    FWD_CHOSEN.clear()


def fwd_configs(head_dim: int, dtype: torch.dtype, causal: bool) -> list[FwdConfig]:
    """Candidate configs, best first (timed on H200); later ones are
    fallbacks when a config does not fit the GPU's registers or shared memory."""
    if interpreting():
        # small tiles keep the interpreter fast and make small test shapes cross several tiles
        return [FwdConfig(32, 16, 4, 1)]
    bd = block_d(head_dim)
    tuned = [FWD_TUNED[(bd, dtype, causal)]] if (bd, dtype, causal) in FWD_TUNED else []
    if dtype == torch.float32:
        return tuned + [FwdConfig(64, 32, 4, 2), FwdConfig(32, 32, 4, 1)]
    # sweep on H200: 128x64 tiles, 8 warps won at d=64 and d=128, causal
    # or not (4-warp 128-row tiles spill registers at d=128)
    if bd <= 64:
        return tuned + [FwdConfig(128, 64, 8, 4), FwdConfig(128, 64, 4, 3), FwdConfig(64, 64, 4, 2)]
    if bd <= 128:
        return tuned + [FwdConfig(128, 64, 8, 3), FwdConfig(64, 64, 4, 3), FwdConfig(64, 32, 4, 2)]
    # d=256: not timed; 128x64 fits in shared memory (192 KB, ptxas: small spills)
    return tuned + [FwdConfig(128, 64, 8, 2), FwdConfig(64, 64, 4, 2), FwdConfig(64, 32, 4, 1)]


@dataclass(frozen=True)
class BwdConfig:
    """Tiles of the dk/dv kernel (`kv_block_n` keys x `kv_block_m` queries per step) and of the dq
    kernel (`q_block_m` queries x `q_block_n` keys per step)."""

    kv_block_n: int
    kv_block_m: int
    kv_warps: int
    kv_stages: int
    q_block_m: int
    q_block_n: int
    q_warps: int
    q_stages: int


# (block_d, dtype, causal) -> BwdConfig chosen by timing (benchmarks/block_attention.py --sweep)
BWD_TUNED: dict[tuple[int, torch.dtype, bool], BwdConfig] = {}
DKDV_CHOSEN: dict[tuple, BwdConfig] = {}
DQ_CHOSEN: dict[tuple, BwdConfig] = {}


def set_tuned_bwd_config(head_dim: int, dtype: torch.dtype, causal: bool, config: BwdConfig) -> None:
    """Prefer `config` for this head dim/dtype/mask from now on (e.g. the winner of a sweep)."""
    BWD_TUNED[(block_d(head_dim), dtype, causal)] = config
    DKDV_CHOSEN.clear()
    DQ_CHOSEN.clear()


def bwd_configs(head_dim: int, dtype: torch.dtype, causal: bool) -> list[BwdConfig]:
    """Candidate configs, best first (timed on H200); later ones are
    fallbacks for GPUs with fewer registers/shared memory."""
    if interpreting():
        return [BwdConfig(32, 16, 4, 1, 32, 16, 4, 1)]
    bd = block_d(head_dim)
    tuned = [BWD_TUNED[(bd, dtype, causal)]] if (bd, dtype, causal) in BWD_TUNED else []
    if dtype == torch.float32:
        return tuned + [BwdConfig(64, 32, 4, 2, 64, 32, 4, 2), BwdConfig(32, 32, 4, 1, 32, 32, 4, 1)]
    # sweep on H200, each kernel timed alone
    if bd <= 64:
        kv = (64, 64, 4, 3) if causal else (64, 32, 4, 3)
        return tuned + [BwdConfig(*kv, 128, 32, 8, 3), BwdConfig(64, 32, 4, 2, 64, 32, 4, 2)]
    if bd <= 128:
        return tuned + [BwdConfig(128, 64, 8, 3, 128, 64, 8, 3), BwdConfig(64, 32, 4, 2, 64, 64, 4, 2)]
    # d=256: not timed; sized to fit shared memory (ptxas: spills)
    return tuned + [BwdConfig(64, 64, 8, 2, 64, 64, 8, 2), BwdConfig(64, 32, 8, 1, 64, 32, 8, 1),
                    BwdConfig(32, 32, 4, 1, 32, 32, 4, 1)]


def launch_with_fallback(chosen: dict, key: tuple, configs: list, launch) -> None:
    """Run `launch(config)` with the cached config for `key`, else the first candidate that fits the
    GPU (Triton raises OutOfResources at launch when registers/shared memory do not suffice)."""
    if key in chosen:
        launch(chosen[key])
        return
    last_err: Exception | None = None
    for cfg in configs:
        try:
            launch(cfg)
        except triton.runtime.errors.OutOfResources as err:  # pragma: no cover - GPU specific
            last_err = err
            continue
        chosen[key] = cfg
        return
    raise RuntimeError(f"no kernel config fits this GPU for {key}") from last_err


# ---------------------------------------------------------------------------------------------------
# argument checks


def check_intervals(lo: torch.Tensor, hi: torch.Tensor, n: int, device: torch.device, what: str,
                    names: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Interval bounds: int32 `[n]` on `device` each (made contiguous)."""
    for name, t in zip(names.split("/"), (lo, hi)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (n,) or t.device != device:
            desc = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}: {name} must be an int32 tensor of shape ({n},) on {device}, got {desc}")
    return lo.contiguous(), hi.contiguous()


def check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype == torch.float64:
        raise ValueError(
            f"{what}: the Triton kernels take bfloat16, float16 or float32, not float64; "
            "use backend='torch' for float64"
        )
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: unsupported dtype {t.dtype} (use bfloat16, float16 or float32)")


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Inputs may have any strides except along the head dim, which the kernels read as a vector."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> None:
    """q, k `[b, s, h, d_qk]`, v `[b, sk, hkv, d_v]`: V may have its own head dim (MLA: 192 / 128)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{what}: q, k, v must be [batch, seqlen, nheads, headdim]")
    b, _, h, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(
            f"{what}: incompatible shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if max(d, v.shape[3]) > 256:
        raise ValueError(f"{what}: head dim {max(d, v.shape[3])} > 256 is not supported")


def check_accumulator(acc: torch.Tensor, shape: tuple, device: torch.device, what: str, name: str) -> None:
    """A float32 tensor of `shape` on `device`, contiguous in its last dim (kernels update it in place)."""
    if tuple(acc.shape) != tuple(shape) or acc.dtype != torch.float32 or acc.device != device:
        raise ValueError(
            f"{what}: {name} must be float32 {tuple(shape)} on {device}, got {acc.dtype} {tuple(acc.shape)} "
            f"on {acc.device}"
        )
    if acc.stride(-1) != 1:
        raise ValueError(f"{what}: {name} must be contiguous in its last dim (it is updated in place)")
