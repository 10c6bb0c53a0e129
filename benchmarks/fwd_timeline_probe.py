"""Timeline of the Hopper forward's programs on one GPU: where a work tile's time goes.

Builds an instrumented copy of `kernels/attention_fwd_hopper.py` (source edits, in a temporary module: the
production kernel carries no probe) whose first consumer warpgroup, second consumer and loader write
`%clock64` (per-SM cycles) at fixed points of each work tile and program, with `%smid`. Per input
(masked_attention.py's, b1 h32 d128 bf16, S 32K), one program per tile: from the program's start to its
bounds, to its first S, through the key-tile loop, through the epilogue, and the gap on the SM between
one program's end and the next one's start; persistent programs (interval masks, as the launcher runs
them): per tile the time from the previous tile's end to this one's bounds, to its first S, the loop, the
epilogue, and the share of the programs' time outside the loops. The instrumented kernel's time next to
the plain one's (the probe's own cost).

Usage (on a GPU): python benchmarks/fwd_timeline_probe.py [--out DIR] [--seqlen S]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import _bench, save_result  # noqa: E402
from masked_probe import cases  # noqa: E402

SLOTS = 12  # per program: see EVENTS
EVENTS = ("start", "load_issued", "bounds", "first_s", "loop_end", "epilogue_end", "smid", "n_tiles",
          "wg1_epilogue_end", "loader_end", "joined", "wg1_first_s")

CLOCK = 'gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)'
SMID = 'gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)'


def _edits(src: str) -> str:
    """The instrumented source: `Tl` rides in `walk`; each edit must apply exactly once."""
    def sub(old: str, new: str, count: int = 1) -> None:
        nonlocal src
        assert src.count(old) == count, (old, src.count(old))
        src = src.replace(old, new)

    sub("num_m, H, GROUP, SQ, SK, OFFSET, KeyLo, KeyHi, Counter, TOTAL = walk",
        "num_m, H, GROUP, SQ, SK, OFFSET, KeyLo, KeyHi, Counter, TOTAL, Tl = walk", 3)
    sub("B, H, GROUP, SQ, SK, OFFSET, qk_scale, KeyLo, KeyHi, Counter,\n",
        "B, H, GROUP, SQ, SK, OFFSET, qk_scale, KeyLo, KeyHi, Counter, Tl,\n")
    sub("walk = (num_m, H, GROUP, SQ, SK, OFFSET, KeyLo, KeyHi, Counter, num_m * B * H)",
        f"walk = (num_m, H, GROUP, SQ, SK, OFFSET, KeyLo, KeyHi, Counter, num_m * B * H, Tl)\n"
        f"    gl.store(Tl + (num_m * B * H + gl.program_id(0)) * {SLOTS} + 0, {CLOCK})\n"
        f"    gl.store(Tl + (num_m * B * H + gl.program_id(0)) * {SLOTS} + 6, {SMID}.to(gl.int64))")
    # loader: after Q's TMA is issued
    sub("                                        q_smem.index(qs * CONSUMERS + c))\n",
        "                                        q_smem.index(qs * CONSUMERS + c))\n"
        f"    gl.store(walk[10] + t * {SLOTS} + 1, {CLOCK})\n")
    # first consumer: bounds known, first S back, loop done, epilogue stored
    sub("    m_i = gl.full([ROWS], float(\"-inf\"), gl.float32, row_layout)\n",
        "    m_i = gl.full([ROWS], float(\"-inf\"), gl.float32, row_layout)\n"
        f"    if WG == 0:\n        gl.store(Tl + t * {SLOTS} + 2, {CLOCK})\n"
        f"        gl.store(Tl + t * {SLOTS} + 7, n_tiles.to(gl.int64))\n"
        f"        gl.store(Tl + t * {SLOTS} + 6, gl.program_id(0).to(gl.int64))\n")
    first_s = ("        mbarrier.arrive(k_empty.index(s), count=1)\n"
               "        p, m_i, l_i, alpha = _softmax_tile(qk, m_i, l_i, offs_m, offs_n0, n_lo,")
    sub(first_s,
        f"        if WG == 0:\n            gl.store(Tl + t * {SLOTS} + 3, {CLOCK})\n"
        f"        if WG == 1:\n            gl.store(Tl + t * {SLOTS} + 11, {CLOCK})\n" + first_s)
    sub("    if INTERVALS:\n        # rows that see no key of this block",
        f"    if WG == 0:\n        gl.store(Tl + t * {SLOTS} + 4, {CLOCK})\n"
        "    if INTERVALS:\n        # rows that see no key of this block")
    sub("    return it + n_tiles\n\n\n@gluon.jit\ndef _fwd_consume",
        f"    if WG == 0:\n        gl.store(Tl + t * {SLOTS} + 5, {CLOCK})\n"
        f"    if WG == 1:\n        gl.store(Tl + t * {SLOTS} + 8, {CLOCK})\n"
        "    return it + n_tiles\n\n\n@gluon.jit\ndef _fwd_consume")
    # loader's end, and the default partition past the join
    sub("    return it + n_tiles\n\n\n@gluon.jit\ndef _fwd_load",
        f"    gl.store(walk[10] + t * {SLOTS} + 9, {CLOCK})\n"
        "    return it + n_tiles\n\n\n@gluon.jit\ndef _fwd_load")
    sub("        ), [4, 1], [CONSUMER_REGS, 24])\n",
        "        ), [4, 1], [CONSUMER_REGS, 24])\n"
        f"        gl.store(Tl + (num_m * B * H + gl.program_id(0)) * {SLOTS} + 10, {CLOCK})\n")
    return src


def instrumented_module():
    from ringlse.kernels import attention_fwd_hopper as G

    with open(G.__file__) as f:
        src = _edits(f.read())
    path = os.path.join(tempfile.mkdtemp(), "attention_fwd_hopper_timeline.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("attention_fwd_hopper_timeline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def launch(T, q, k, v, out, lse, tl, scale, causal, key_lo=None, key_hi=None, programs=None):
    """`hopper_forward`'s launch (128 rows; one program per tile, or `programs` persistent ones, which take
    tiles from a counter under interval masks and round-robin otherwise) with the timeline buffer (rows
    of the tiles, then rows of the programs)."""
    import triton
    from triton.experimental.gluon import language as gl

    from ringlse.kernels.host import rows_view

    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    descs = []
    for t, rows in ((q, 64), (k, 128), (v, 128), (out, 64)):  # O through TMA, as 128-row tiles do
        shape, strides = rows_view(t)
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
        descs.append(T.TensorDescriptor(t, shape, strides, [rows, d], layout))
    total = triton.cdiv(sq, 128) * b * h
    dynamic = programs is not None and key_lo is not None
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else lse
    T._attn_fwd_hopper_kernel[(total if programs is None else programs,)](
        *descs, out, lse, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        b, h, h // hkv, sq, sk, 0, scale * 1.4426950408889634, key_lo, key_hi, counter, tl,
        HEAD_D=d, BLOCK_M=128, BLOCK_N=128, STAGES=2, CAUSAL=causal, INTERVALS=key_lo is not None, ACCUM=False,
        PERSISTENT=programs is not None, DYNAMIC=dynamic, TMA_STORE=True, CONSUMER_REGS=240, num_warps=4,
        maxnreg=168)
    return total


def summarize_persistent(tl: torch.Tensor, total: int, cycles_per_us: float) -> dict:
    """Persistent programs: per work tile (medians, µs) the first consumer's time from the previous tile's
    end to this one's bounds, to its first S, per key tile, in the epilogue; and the share of the
    programs' spans their first consumers spent outside the key-tile loops."""
    e = tl.cpu().long()
    tiles, progs = e[:total], e[total:]
    us = lambda x: (x.float() / cycles_per_us)  # noqa: E731
    between, to_first, per_tile, epi = [], [], [], []
    loop_sum = span_sum = 0
    for p in range(progs.shape[0]):
        mine = tiles[tiles[:, 6] == p]
        mine = mine[mine[:, 3].argsort()]
        if mine.shape[0] == 0:
            continue
        between.append(us(mine[1:, 2] - mine[:-1, 5]))
        to_first.append(us(mine[:, 3] - mine[:, 2]))
        per_tile.append(us(mine[:, 4] - mine[:, 3]) / mine[:, 7].clamp(min=1))
        epi.append(us(mine[:, 5] - mine[:, 4]))
        loop_sum += int((mine[:, 4] - mine[:, 3]).sum())
        span_sum += int(progs[p, 10] - progs[p, 0])
    cat = lambda xs: torch.cat(xs)  # noqa: E731
    return {"tiles": total, "programs": int(progs.shape[0]),
            "n_tiles_mean": float(tiles[:, 7].float().mean()),
            "between_tiles_us": float(cat(between).median()), "to_first_s_us": float(cat(to_first).median()),
            "loop_us_per_key_tile": float(cat(per_tile).median()), "epilogue_us": float(cat(epi).median()),
            "outside_loop_share": 1.0 - loop_sum / span_sum}


def summarize(tl: torch.Tensor, cycles_per_us: float) -> dict:
    """Medians (µs) of each phase, and per-SM gaps between consecutive programs."""
    e = tl.cpu().long()
    total = e.shape[0] // 2
    e = torch.cat([e[:total, :], e[total:, :]], 1)  # tile t's row next to program t's (one per tile)
    e[:, 0], e[:, 6], e[:, 10] = e[:, SLOTS + 0], e[:, SLOTS + 6], e[:, SLOTS + 10]
    start, load, bounds, first, loop_end, end, smid, n, end1, load_end, joined, first1 = (e[:, i] for i in range(12))
    us = lambda x: (x.float() / cycles_per_us)  # noqa: E731
    ran = n > 0
    out = {
        "programs": int(e.shape[0]), "programs_with_keys": int(ran.sum()),
        "n_tiles_mean": float(n[ran].float().mean()),
        "to_load_issue_us": float(us(load - start).median()),
        "to_bounds_us": float(us(bounds - start).median()),
        "bounds_to_first_s_us": float(us(first - bounds)[ran].median()),
        "loop_us_per_tile": float((us(loop_end - first)[ran] / n[ran].clamp(min=1)).median()),
        "epilogue_us": float(us(end - loop_end).median()),
        "program_us_mean": float(us(end - start).mean()),
        "wg1_first_s_minus_wg0_us": float(us(first1 - first)[ran].median()),
        "wg1_end_minus_wg0_us": float(us(end1 - end).median()),
        "loader_end_us": float(us(load_end - start).median()),
        "joined_minus_last_end_us": float(us(joined - torch.maximum(end, end1)).median()),
    }
    gaps = []
    for sm in smid.unique():
        idx = (smid == sm).nonzero().flatten()
        order = idx[start[idx].argsort()]
        s_, e_ = start[order], joined[order]
        gaps.append(us(s_[1:] - e_[:-1]))
    g = torch.cat(gaps)
    out["gap_between_programs_us_median"] = float(g.median())
    out["gap_between_programs_us_mean"] = float(g.mean())
    # the SM's busy span over the programs it ran: first start to last end
    spans = []
    for sm in smid.unique():
        idx = (smid == sm).nonzero().flatten()
        spans.append(us(joined[idx].max() - start[idx].min()))
    out["sm_span_us_max"] = float(torch.stack(spans).max())
    out["sm_span_us_min"] = float(torch.stack(spans).min())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlen", type=int, default=32768)
    args = ap.parse_args()
    import triton

    from ringlse.kernels import attention_fwd_hopper as G

    T = instrumented_module()
    h, d = 32, 128
    scale = d**-0.5
    clock_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", None)  # metadata; not every torch has it
    rows = []
    for name, b, s, mask, pairs in cases(args.seqlen):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        o = torch.empty_like(q)
        lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
        causal = mask["causal"]
        lo, hi = mask.get("key_lo"), mask.get("key_hi")
        total = triton.cdiv(s, 128) * b * h
        plain_ms = _bench(lambda i: G.hopper_forward(q, k, v, o, lse, softmax_scale=scale, causal=causal, offset=0,
                                                     accum=False, key_lo=lo, key_hi=hi), 1)
        if b > 1 and s % 128:
            continue
        # one program per tile; persistent programs too where the launcher runs them (interval masks)
        for programs in (None, G.sm_count(0)) if lo is not None else (None,):
            n_prog = total if programs is None else programs
            tl = torch.zeros(total + n_prog, SLOTS, dtype=torch.int64, device="cuda")
            run = lambda: launch(T, q, k, v, o, lse, tl, scale, causal, lo, hi, programs)  # noqa: E731
            inst_ms = _bench(lambda i: run(), 1)
            # cycles per µs from one timed launch: the busiest SM's span against the kernel's wall time
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            run()
            ev1.record()
            torch.cuda.synchronize()
            wall_us = ev0.elapsed_time(ev1) * 1e3
            pr = tl[total:].cpu().long()
            span_cycles = max(int(pr[pr[:, 6] == sm, 10].max() - pr[pr[:, 6] == sm, 0].min())
                              for sm in pr[:, 6].unique())
            cyc_per_us = span_cycles / wall_us  # a lower bound of the clock (the launch's own latency in wall)
            row = {"input": name, "batch": b, "seqlen": s, "visible_pairs": pairs, "plain_ms": plain_ms,
                   "persistent": programs is not None, "instrumented_ms": inst_ms, "wall_us": wall_us,
                   "cycles_per_us": cyc_per_us, "tflops": 4.0 * h * d * pairs / plain_ms / 1e9}
            row.update(summarize(tl, cyc_per_us) if programs is None else summarize_persistent(tl, total, cyc_per_us))
            rows.append(row)
            print(name, " ".join(f"{k_}={v_:.4g}" if isinstance(v_, float) else f"{k_}={v_}"
                                 for k_, v_ in row.items()), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv), "clock_khz": clock_khz,
              "events": EVENTS, "rows": rows}
    if args.out:
        print(save_result(args.out, "fwd_timeline_probe", result))


if __name__ == "__main__":
    main()
