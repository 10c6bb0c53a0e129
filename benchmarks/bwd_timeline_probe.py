"""Timeline of the Hopper backward's programs (dk/dv with dq fused) on one GPU: where a key tile's time goes.

Builds an instrumented copy of `kernels/attention_bwd_hopper.py` (source edits, in a temporary module: the
production kernel carries no probe) whose first consumer warpgroup, writer warps and loader write
`%clock64` (per-SM cycles) at fixed points of each program, with `%smid`, and add up the cycles spent in
some waits. Per input (masked_attention.py's, b1 h32 d128 bf16, S 32K), medians or means over programs:
from the consumer's start to K/V in shared memory, the first step, each later step, the consumer's
epilogue (dk, dv handed to the writers), the writers' end after it; the cycles the consumer waits for
Q/dO (the loader), for the dS halves and for a free dQ slot (the writers), and the writers' waits for
their turn; the gap on an SM between one program's end and the next one's start, and the share of the
SMs' busy time spent in the step loops. The instrumented kernel's time next to the plain one's.

Usage (on a GPU): python benchmarks/bwd_timeline_probe.py [--out DIR] [--seqlen S]
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
from fwd_ab import all_cases  # noqa: E402

SLOTS = 16
EVENTS = ("c_start", "c_kv", "c_step0", "c_loop_end", "c_end", "w0_end", "smid", "n_steps", "w0_turn_wait",
          "c_slot_wait", "c_ready_wait", "w1_end", "loader_start", "w0_full_wait", "w1_turn_wait", "c_ds_wait")
CLOCK = 'gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)'
CLOCK32 = 'gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)'
SMID = 'gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)'
PROG = "(gl.program_id(1) * gl.num_programs(0) + gl.program_id(0))"
ZERO = "(gl.program_id(0) * 0)"  # int32 sums: fewer registers (the consumer spills)


def _edits(src: str, waits: bool) -> str:
    """The instrumented source: the buffer `Tl` rides in `walk`; each edit must apply as counted. Without
    `waits`, only the timestamps (the sums of wait cycles cost the consumer registers: spills)."""
    def sub(old: str, new: str, count: int = 1) -> None:
        nonlocal src
        assert src.count(old) == count, (old, src.count(old))
        src = src.replace(old, new)

    def at(slot: int, value: str = CLOCK) -> str:
        return f"gl.store(Tl + {PROG} * {SLOTS} + {slot}, {value})"

    def wait_sum(line: str, acc: str) -> None:
        """`line` (one statement) with its cycles added to `acc` (32-bit: differences wrap right)."""
        if waits:
            indent = line[:len(line) - len(line.lstrip())]
            sub(line, f"{indent}t_w = {CLOCK32}\n{line}{indent}{acc} += {CLOCK32} - t_w\n")

    sub("HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi = walk", "HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi, Tl = walk",
        5)
    sub("HKV, GROUP, SQ, SK, OFFSET, qk_scale, dk_scale, dq_scale, QueryLo, QueryHi,\n",
        "HKV, GROUP, SQ, SK, OFFSET, qk_scale, dk_scale, dq_scale, QueryLo, QueryHi, Tl,\n")
    sub("walk = (HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi)", "walk = (HKV, GROUP, SQ, SK, OFFSET, QueryLo, QueryHi, Tl)")
    sub("hkv, h // hkv, sq, sk, offset, qk_scale, dk_scale, dq_scale, query_lo, query_hi,\n",
        "hkv, h // hkv, sq, sk, offset, qk_scale, dk_scale, dq_scale, query_lo, query_hi, TIMELINE[0],\n")
    # loader
    kv = "    mbarrier.expect(kv_ready, CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))\n"
    sub(kv, f"    {at(12)}\n" + kv)
    # consumer: start, K/V in, first step, waits, loop end, hand-off
    sub("    k_rows = k_smem.index(WG)\n",
        f"    if WG == 0:\n        {at(0)}\n        {at(6, SMID + '.to(gl.int64)')}\n"
        f"        {at(7, 'n_steps.to(gl.int64)')}\n    k_rows = k_smem.index(WG)\n")
    sub("    mbarrier.wait(kv_ready, 0)\n    it = 0\n",
        f"    mbarrier.wait(kv_ready, 0)\n    it = 0\n    if WG == 0:\n        {at(1)}\n"
        f"    w_ready = {ZERO}\n    w_slot = {ZERO}\n    w_ds = {ZERO}\n")
    wait_sum("            mbarrier.wait(q_ready.index(s), ph)\n", "w_ready")
    wait_sum("            mbarrier.wait(do_ready.index(s), ph)\n", "w_ready")
    wait_sum("                mbarrier.wait(ds_ready.index(s), ds_phase)\n", "w_ds")
    wait_sum("                mbarrier.wait(dq_empty.index(s), ds_phase ^ 1)\n", "w_slot")
    sub("                    mbarrier.arrive(dq_full.index(WG), count=1)\n            it += 1\n",
        "                    mbarrier.arrive(dq_full.index(WG), count=1)\n"
        f"            if WG == 0:\n                if it == 0:\n                    {at(2)}\n            it += 1\n")
    sub("\n    if INTERVALS:\n        # keys no query of this block sees",
        f"\n    if WG == 0:\n        {at(3)}\n        {at(9, 'w_slot.to(gl.int64)')}\n        {at(10, 'w_ready.to(gl.int64)')}\n"
        f"        {at(15, 'w_ds.to(gl.int64)')}\n    if INTERVALS:\n        # keys no query of this block sees")
    done = ("        dq_smem.index(WG).store(dv)\n        fence_async_shared()\n"
            "        mbarrier.arrive(dq_full.index(WG), count=1 + DQ_HALVES)\n")
    sub(done, done + f"        if WG == 0:\n            {at(4)}\n")
    # writers: turn waits, waits for a full slot, end
    sub("    for it in range(W, n_steps * n_g, 2):\n",
        f"    w_turn = {ZERO}\n    w_full = {ZERO}\n    for it in range(W, n_steps * n_g, 2):\n")
    wait_sum("            wait_turn(sem, n_kt - kt - 1)\n", "w_turn")
    wait_sum("        mbarrier.wait(dq_full.index(W), (it // 2) & 1)\n", "w_full")
    sub("        # kernel's end completes the add)\n        tma.store_wait(0)\n",
        "        # kernel's end completes the add)\n        tma.store_wait(0)\n"
        f"    if W == 0:\n        {at(5)}\n        {at(8, 'w_turn.to(gl.int64)')}\n        {at(13, 'w_full.to(gl.int64)')}\n"
        f"    else:\n        {at(11)}\n        {at(14, 'w_turn.to(gl.int64)')}\n")
    return src + "\n\nTIMELINE = [None]  # the buffer the launch passes\n"


def instrumented_module(waits: bool):
    from ringlse.kernels import attention_bwd_hopper as G

    with open(G.__file__) as f:
        src = _edits(f.read(), waits)
    path = os.path.join(tempfile.mkdtemp(), f"attention_bwd_hopper_timeline_{int(waits)}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"attention_bwd_hopper_timeline_{int(waits)}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def summarize(tl: torch.Tensor, cycles_per_us: float) -> dict:
    """Medians / means (µs) of each phase and wait over programs, the gaps between programs on an SM and
    the share of the SMs' busy spans spent in the consumers' step loops."""
    e = tl.cpu().long()
    (c_start, c_kv, c_step0, c_loop_end, c_end, w0_end, smid, n, w0_turn, c_slot, c_ready, w1_end, l_start,
     w0_full, w1_turn, c_ds) = (e[:, i] for i in range(SLOTS))
    us = lambda x: x.float() / cycles_per_us  # noqa: E731
    ran = n > 1
    end = torch.maximum(torch.maximum(c_end, w0_end), w1_end)
    start = torch.minimum(c_start, l_start)
    out = {
        "programs": int(e.shape[0]), "n_steps_mean": float(n.float().mean()),
        "to_kv_us": float(us(c_kv - start).median()),
        "first_step_us": float(us(c_step0 - c_kv)[ran].median()),
        "later_step_us": float((us(c_loop_end - c_step0)[ran] / (n[ran] - 1)).median()),
        "consumer_epilogue_us": float(us(c_end - c_loop_end).median()),
        "writers_after_consumer_us": float(us(end - c_end).median()),
        "program_us_mean": float(us(end - start).mean()),
        "per_program_us_mean": {k_: float(us(x).mean()) for k_, x in (
            ("consumer_waits_qdo", c_ready), ("consumer_waits_ds", c_ds), ("consumer_waits_slot", c_slot),
            ("writer0_waits_turn", w0_turn), ("writer1_waits_turn", w1_turn), ("writer0_waits_full", w0_full))},
    }
    gaps, loop_share = [], []
    for sm in smid.unique():
        idx = (smid == sm).nonzero().flatten()
        order = idx[start[idx].argsort()]
        gaps.append(us(start[order][1:] - end[order][:-1]))
        busy = end[idx].max() - start[idx].min()
        loop_share.append(float((c_loop_end[idx] - c_kv[idx]).sum()) / float(busy))
    g = torch.cat(gaps)
    out.update(gap_between_programs_us_median=float(g.median()), gap_between_programs_us_mean=float(g.mean()),
               loop_share_of_sm_time=sum(loop_share) / len(loop_share))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlen", type=int, default=32768)
    args = ap.parse_args()
    import triton

    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_bwd_hopper as G
    from ringlse.kernels import attention_fwd as F

    mods = {waits: instrumented_module(waits) for waits in (False, True)}
    rows = []
    for name, b, s, h, d, mask, pairs in all_cases(args.seqlen, ("causal", "key_lo", "key_hi", "query_lo",
                                                                 "query_hi"), dense=()):
        if b > 1:
            continue
        causal = mask["causal"]
        iv = {k_: v_ for k_, v_ in mask.items() if k_ != "causal"}
        g = torch.Generator(device="cuda").manual_seed(s + d)
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = d**-0.5
        out, lse = F.attention_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=0, k_start=0,
                                       key_lo=iv.get("key_lo"), key_hi=iv.get("key_hi"))
        delta = B.attention_delta(do, out)
        common = dict(qk_scale=scale * F.LOG2E, dk_scale=scale, causal=causal, offset=0,
                      query_lo=iv.get("query_lo"), query_hi=iv.get("query_hi"), dq_scale=scale)
        accs = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]

        def run(mod):
            mod.hopper_dkdv(do, q, k, v, lse, delta, accs[1], accs[2], dq_acc=accs[0], **common)
        n_prog = triton.cdiv(s, G.BLOCK_N) * b * h
        plain_ms = _bench(lambda i: run(G), 1)
        for waits, T in mods.items():
            T.TIMELINE[0] = tl = torch.zeros(n_prog, SLOTS, dtype=torch.int64, device="cuda")
            inst_ms = _bench(lambda i: run(T), 1)
            torch.cuda.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            run(T)
            ev1.record()
            torch.cuda.synchronize()
            wall_us = ev0.elapsed_time(ev1) * 1e3
            e = tl.cpu().long()
            end = torch.maximum(torch.maximum(e[:, 4], e[:, 5]), e[:, 11])
            start = torch.minimum(e[:, 0], e[:, 12])
            span_cycles = max(int(end[e[:, 6] == sm].max() - start[e[:, 6] == sm].min()) for sm in e[:, 6].unique())
            cyc_per_us = span_cycles / wall_us  # a lower bound of the clock (the launch's own latency is in wall)
            row = {"input": name, "waits": waits, "seqlen": s, "visible_pairs": pairs, "plain_ms": plain_ms,
                   "instrumented_ms": inst_ms, "wall_us": wall_us, "cycles_per_us": cyc_per_us,
                   "tflops": 2 * 5.0 * h * d * pairs / plain_ms / 1e9}
            row.update(summarize(tl, cyc_per_us))
            if not waits:
                del row["per_program_us_mean"]
            rows.append(row)
            print(name, {k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()
                         if k_ != "input"}, flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv), "events": EVENTS, "rows": rows}
    if args.out:
        print(save_result(args.out, "bwd_timeline_probe", result))


if __name__ == "__main__":
    main()
