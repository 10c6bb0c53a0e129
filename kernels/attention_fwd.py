"""Triton forward block attention with lse, and an in-kernel merge into running accumulators.

One program owns `BLOCK_M` query rows of one head and walks the key tiles that its rows can see
(FlashAttention-2 order, online softmax in base 2). Causal blocks (DESIGN §4: key `j` visible to query
`i` iff `k_start + j <= q_start + i`) split the walk in two: tiles every row of the program sees
entirely run without any mask; only the tiles the causal boundary (or the key tail) crosses pay for
masking; tiles no row sees are never visited. With accumulators the epilogue merges the block into
`(out_acc, lse_acc)` (DESIGN §3), so one ring step is one kernel.

Precision: bf16/fp16 operands with float32 accumulation. float32 inputs use 3-pass TF32 tensor-core
dots (`input_precision="tf32x3"`): plain TF32 missed DESIGN §7's float32 bound (1e-3 * max|ref|).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ringlse.kernels.host import cdiv, next_power_of_2
from ringlse.positions import BlockKind, block_kind

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q,
    k_ptrs, v_ptrs, stride_kn, stride_vn,
    offs_m, offs_d, lo, hi, SK, OFFSET, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Online softmax over key tiles `[lo, hi)`; `k_ptrs` is a `[BLOCK_D, BLOCK_N]` (transposed) tile
    at key 0, `v_ptrs` a `[BLOCK_N, BLOCK_D]` tile at key 0."""
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_D
    k_ptrs += lo * stride_kn
    v_ptrs += lo * stride_vn
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASKED:
            n_ok = offs_n < SK
            kt = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        elif BLOCK_D != HEAD_D:
            kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        else:
            kt = tl.load(k_ptrs)
        qk = tl.dot(q, kt, input_precision=DOT_PREC)
        if MASKED:
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # a row that has seen no key yet keeps max -inf: subtract 0 instead so that
            # exp2(-inf - -inf) never makes a NaN (its p and alpha come out 0)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            # every key here is visible, so m_new is finite; scale > 0 (the launcher makes it so),
            # hence max(qk) * scale == max(qk * scale) and the scaling fuses into one FMA
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_D:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    H, GROUP, SQ, SK, OFFSET, qk_scale,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ACCUM: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid `(cdiv(SQ, BLOCK_M), B * H)`. `qk_scale` = softmax_scale * log2(e). With ACCUM, `Out`/`Lse`
    are the float32 running state, read and merged in place; otherwise fresh outputs."""
    num_m = tl.num_programs(0)
    pid_m = tl.program_id(0)
    if CAUSAL:
        # the last query tiles see the most keys: start them first so the short ones fill the tail
        pid_m = num_m - 1 - pid_m
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = pid_bh % H
    off_hk = (off_h // GROUP).to(tl.int64)
    off_h = off_h.to(tl.int64)

    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < SQ
    d_ok = offs_d < HEAD_D

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + tl.arange(0, BLOCK_N)[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + tl.arange(0, BLOCK_N)[:, None] * stride_vs + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # key tiles [0, n_full) need no mask; [n_full, n_hi) are cut by the causal boundary or the key tail
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
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, offs_d, 0, n_full, SK, OFFSET,
        qk_scale, BLOCK_N, HEAD_D, BLOCK_D, CAUSAL, False, DOT_PREC,
    )
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_ks, stride_vs, offs_m, offs_d, n_full, n_hi, SK, OFFSET,
        qk_scale, BLOCK_N, HEAD_D, BLOCK_D, CAUSAL, True, DOT_PREC,
    )

    # rows that saw no key: l = 0 -> out 0, lse -inf (never 0/0)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))

    o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    lse_ptrs = Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_ls
    o_mask = m_ok[:, None] & d_ok[None, :]
    if ACCUM:
        # DESIGN §3 in base 2: subtract the larger lse; a -inf side has weight exactly 0 and its
        # (unread) output cannot leak a NaN; all -inf gives (0, -inf)
        old2 = tl.load(lse_ptrs, mask=m_ok, other=float("-inf")) * 1.4426950408889634
        top = tl.maximum(old2, lse2)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.math.exp2(old2 - top)
        w_new = tl.math.exp2(lse2 - top)
        total = w_old + w_new
        inv = 1.0 / tl.where(total == 0.0, 1.0, total)
        o_old = tl.load(o_ptrs, mask=o_mask, other=0.0)
        o_old = tl.where(w_old[:, None] > 0.0, o_old, 0.0)
        out = (o_old * (w_old * inv)[:, None]) + out * (w_new * inv)[:, None]
        lse2 = top + tl.math.log2(total)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptrs, lse2 * 0.6931471805599453, mask=m_ok)


# ---------------------------------------------------------------------------------------------------
# launcher


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def interpreting() -> bool:
    """True when Triton kernels run under its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs: 3-pass TF32 ("tf32x3", about float32 accuracy on the tensor cores; plain TF32
    missed DESIGN §7's 1e-3 * max|ref| by 1.5-3x on H200). 16-bit inputs ignore it."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    """The padded head dim a kernel tile uses: a power of two >= 16 (dots need K >= 16)."""
    return max(16, next_power_of_2(head_dim))


# configs chosen by timing on the GPU at hand (benchmarks/block_attention.py --sweep sets them):
# (block_d, dtype, causal) -> FwdConfig, tried before the built-in table
FWD_TUNED: dict[tuple[int, torch.dtype, bool], FwdConfig] = {}
# the config that compiled and ran for a (head_dim, dtype, causal, accum, device) key
_FWD_CHOSEN: dict[tuple, FwdConfig] = {}


def set_tuned_fwd_config(head_dim: int, dtype: torch.dtype, causal: bool, config: FwdConfig) -> None:
    """Prefer `config` for this head dim/dtype/mask from now on (e.g. the winner of a sweep)."""
    FWD_TUNED[(block_d(head_dim), dtype, causal)] = config
    _FWD_CHOSEN.clear()


def fwd_configs(head_dim: int, dtype: torch.dtype, causal: bool) -> list[FwdConfig]:
    """Candidate configs, best first (timed on H200, see benchmarks/NOTES.md); later ones are
    fallbacks when a config does not fit the GPU's registers or shared memory."""
    if interpreting():
        # small tiles keep the interpreter fast and make small test shapes cross several tiles
        return [FwdConfig(32, 16, 4, 1)]
    bd = block_d(head_dim)
    tuned = [FWD_TUNED[(bd, dtype, causal)]] if (bd, dtype, causal) in FWD_TUNED else []
    if dtype == torch.float32:
        return tuned + [FwdConfig(64, 32, 4, 2), FwdConfig(32, 32, 4, 1)]
    # sweep on H200 (benchmarks/NOTES.md, step 1): 128x64 tiles, 8 warps won at d=64 and d=128, causal
    # or not (4-warp 128-row tiles spill registers at d=128)
    if bd <= 64:
        return tuned + [FwdConfig(128, 64, 8, 4), FwdConfig(128, 64, 4, 3), FwdConfig(64, 64, 4, 2)]
    if bd <= 128:
        return tuned + [FwdConfig(128, 64, 8, 3), FwdConfig(64, 64, 4, 3), FwdConfig(64, 32, 4, 2)]
    # d=256: not timed; 128x64 fits in shared memory (192 KB, ptxas: small spills)
    return tuned + [FwdConfig(128, 64, 8, 2), FwdConfig(64, 64, 4, 2), FwdConfig(64, 32, 4, 1)]


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
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{what}: q, k, v must be [batch, seqlen, nheads, headdim]")
    b, _, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(
            f"{what}: incompatible shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{what}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if d > 256:
        raise ValueError(f"{what}: head dim {d} > 256 is not supported")


def check_state(out_acc: torch.Tensor, lse_acc: torch.Tensor, q: torch.Tensor, what: str) -> None:
    b, sq, h, d = q.shape
    if tuple(out_acc.shape) != (b, sq, h, d) or tuple(lse_acc.shape) != (b, h, sq):
        raise ValueError(
            f"{what}: out_acc must be {(b, sq, h, d)} and lse_acc {(b, h, sq)}, got "
            f"{tuple(out_acc.shape)} and {tuple(lse_acc.shape)}"
        )
    if out_acc.dtype != torch.float32 or lse_acc.dtype != torch.float32:
        raise ValueError(f"{what}: accumulators must be float32, got {out_acc.dtype} and {lse_acc.dtype}")
    if out_acc.stride(-1) != 1:
        raise ValueError(f"{what}: out_acc must be contiguous in its last dim (it is written in place)")
    if out_acc.device != q.device or lse_acc.device != q.device:
        raise ValueError(f"{what}: accumulators must be on {q.device}")


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


def _forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    offset: int,
    accum: bool,
    config: FwdConfig | None = None,
) -> None:
    """Launch the forward kernel writing (or merging into, with `accum`) `out`/`lse`. The caller has
    validated, classified the block and made `softmax_scale >= 0`."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bd = block_d(d)
    qk_scale = softmax_scale * LOG2E

    def launch(cfg: FwdConfig) -> None:
        grid = (cdiv(sq, cfg.block_m), b * h)
        _attn_fwd_kernel[grid](
            q, k, v, out, lse,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            h, h // hkv, sq, sk, offset, qk_scale,
            HEAD_D=d, BLOCK_D=bd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            CAUSAL=causal, ACCUM=accum, DOT_PREC=dot_precision(q.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    if config is not None:
        launch(config)
        return
    key = (d, q.dtype, causal, accum, q.device.index)
    launch_with_fallback(_FWD_CHOSEN, key, fwd_configs(d, q.dtype, causal), launch)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    q_start: int,
    k_start: int,
    out_acc: torch.Tensor | None = None,
    lse_acc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block attention forward (the block-op contract of `ringlse.blockop`).

    Args:
        q: `[b, sq, h, d]`; k, v: `[b, sk, hkv, d]` with `h % hkv == 0` (GQA by indexing, K/V never
            repeated); bf16, fp16 or fp32 (fp32 dots in 3-pass TF32); any strides, last dim contiguous
            preferred (copied otherwise). `d <= 256` (non powers of two are padded in registers).
        softmax_scale: multiplies `q @ k^T`.
        causal: key `j` visible to query `i` iff `k_start + j <= q_start + i`.
        q_start, k_start: global positions of query 0 and key 0 (any integers).
        out_acc: optional float32 `[b, sq, h, d]` running output (may be a strided view).
        lse_acc: optional float32 `[b, h, sq]` running lse (natural log; may be a view).

    Returns:
        Without accumulators: `(out, lse)`, `out` `[b, sq, h, d]` in q's dtype and `lse` `[b, h, sq]`
        float32 natural log; rows that see no key get `out = 0`, `lse = -inf`. With accumulators: the
        block is merged into them in the kernel epilogue (DESIGN §3, `-inf`-safe) and they are
        returned.

    Raises:
        ValueError: float64 or other unsupported dtypes, mismatched shapes, bad accumulators.
    """
    check_dtype(q, "attention_forward")
    check_qkv_shapes(q, k, v, "attention_forward")
    if (out_acc is None) != (lse_acc is None):
        raise ValueError("attention_forward: pass both out_acc and lse_acc, or neither")
    b, sq, h, d = q.shape
    sk = k.shape[1]
    accum = out_acc is not None
    if accum:
        check_state(out_acc, lse_acc, q, "attention_forward")
    kind = block_kind(sq, sk, q_start, k_start, causal)
    if kind is BlockKind.EMPTY:
        # nothing visible: the block's state is (0, -inf); merging it changes nothing except that
        # rows whose running lse is -inf come out as the canonical (0, -inf), as the kernel makes them
        if accum:
            out_acc.masked_fill_(torch.isneginf(lse_acc).transpose(1, 2).unsqueeze(-1), 0.0)
            return out_acc, lse_acc
        return torch.zeros_like(q), torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    scale = float(softmax_scale)
    if scale < 0:
        # the kernel folds the scale into a max taken before scaling, which needs scale >= 0;
        # (-q) . k * |s| is exactly q . k * s
        q, scale = -q, -scale
    if accum:
        out, lse = out_acc, lse_acc
    else:
        out = torch.empty_like(q)
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    _forward_impl(
        q, k, v, out, lse, softmax_scale=scale, causal=kind is BlockKind.PARTIAL,
        offset=q_start - k_start, accum=accum,
    )
    return out, lse
