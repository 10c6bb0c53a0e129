"""A/B of the dense backward's kernels in one process: the split form (the Gluon dk/dv kernel of a former
`kernels/attention_bwd_hopper.py` copy, then the Triton dq kernel) against the installed `hopper_dkdv`
adding dq in the same pass, both into float32 accumulators that TMA indexes (delta computed once,
outside the timing). Also checks that two fused runs give the same dq bits and how far their gradients
are from the split form's.

Usage (on a GPU): python benchmarks/fused_dq_ab.py --before FILE [--out DIR] [--variant NAME ...] [--masked]

`--masked` runs masked_attention.py's inputs instead (b1 h32 d128, S 32K: windows, packed documents, the
dense causal block; the split form's dq kernel walking the same intervals).

`--variant` also times copies of the installed kernel with parts of the dQ path taken out (source edits
in temporary modules, the installed one untouched), to see what each costs: `noturn` adds without
waiting for its turn (not deterministic), `noadd` computes and stages dQ but adds nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fwd_ab import ab_row, all_cases, load_module, save  # noqa: E402

# (batch, heads, kv heads, seqlen, head dim, causal)
SHAPES = (
    (2, 16, 16, 8192, 128, False), (2, 16, 16, 8192, 128, True), (2, 16, 16, 8192, 64, False),
    (2, 16, 16, 8192, 64, True), (1, 32, 32, 16384, 128, True), (1, 32, 32, 16384, 64, True),
    (1, 32, 8, 16384, 128, True), (1, 32, 32, 32768, 128, True),
)

VARIANTS = {
    "noturn": [("            wait_turn(sem, n_kt - kt - 1)\n", "            pass\n")],
    "noadd": [("            wait_turn(sem, n_kt - kt - 1)\n", "            pass\n"),
              ("        tma_add_from_smem(DQ, [off_b * SQ + m0, off_h * HEAD_D], dq_smem.index(W))\n", ""),
              ("        pass_turn(sem, n_kt - kt)\n", "")],  # (edits of session 29's kernel)
}


def variant_module(path: str, name: str, edits: list[tuple[str, str]]):
    src = open(path).read()
    for old, new in edits:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    tmp = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    open(tmp, "w").write(src)
    return load_module(tmp, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a former attention_bwd_hopper.py (split dk/dv)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--also", action="append", default=[], help="another fused attention_bwd_hopper.py copy "
                    "to time (repeatable; named by its file's stem)")
    ap.add_argument("--only", type=int, default=None, help="run only the first N shapes")
    ap.add_argument("--masked", action="store_true", help="masked_attention.py's inputs instead (S 32K)")
    ap.add_argument("--variant", action="append", default=[],
                    help=f"repeatable; one of {sorted(VARIANTS)} or several joined by '+'")
    args = ap.parse_args()
    from ringlse.kernels import attention_bwd as B
    from ringlse.kernels import attention_bwd_hopper as after
    from ringlse.kernels import attention_fwd as F

    before = load_module(args.before, "attention_bwd_hopper_before")
    variants = {}
    for path in args.also:
        variants[os.path.splitext(os.path.basename(path))[0]] = load_module(path, f"also_{len(variants)}")
    for name in args.variant:
        edits = [e for part in name.split("+") for e in VARIANTS[part]]
        variants[name] = variant_module(after.__file__, f"attention_bwd_hopper_{name.replace('+', '_')}", edits)
    if args.masked:
        cases = [(name, b, s_, h, h, d, mask, h * pairs) for name, b, s_, h, d, mask, pairs
                 in all_cases(32768, ("causal", "key_lo", "key_hi", "query_lo", "query_hi"), dense=())]
    else:
        cases = [(f"b{b} h{h}/{hkv} s{s_} d{d} {'causal' if c else 'full'}", b, s_, h, hkv, d, dict(causal=c),
                  b * h * (s_ * (s_ + 1) // 2 if c else s_ * s_)) for b, h, hkv, s_, d, c in SHAPES]
    rows = []
    for name, b, s, h, hkv, d, mask, pairs in cases[:args.only]:
        causal = mask["causal"]
        iv = {k_: v_ for k_, v_ in mask.items() if k_ != "causal"}
        g = torch.Generator(device="cuda").manual_seed(s + d)
        q, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        scale = d**-0.5
        out, lse = F.attention_forward(q, k, v, softmax_scale=scale, causal=causal, q_start=0, k_start=0,
                                       key_lo=iv.get("key_lo"), key_hi=iv.get("key_hi"))
        delta = B.attention_delta(do, out)
        common = dict(qk_scale=scale * F.LOG2E, dk_scale=scale, causal=causal, offset=0,
                      query_lo=iv.get("query_lo"), query_hi=iv.get("query_hi"))
        fns, grads = {}, {}
        for side in ("before", "after", *variants):
            dq, dk, dv = (torch.zeros(t.shape, device="cuda") for t in (q, k, v))

            def fn(_i, side=side, dq=dq, dk=dk, dv=dv):
                if side == "before":
                    before.hopper_dkdv(do, q, k, v, lse, delta, dk, dv, **common)
                    B._backward_impl(do, q, k, v, lse, delta, dq, None, None, qk_scale=common["qk_scale"],
                                     dq_scale=scale, dk_scale=scale, causal=causal, offset=0, **iv)
                else:
                    mod = variants.get(side) or after
                    mod.hopper_dkdv(do, q, k, v, lse, delta, dk, dv, dq_acc=dq, dq_scale=scale, **common)
            fn(0)
            grads[side] = (dq.clone(), dk.clone(), dv.clone())
            fns[side] = fn
        # a second and third fused run from zero: the same bits
        repeats = []
        for _ in range(2):
            dq, dk, dv = (torch.zeros(t.shape, device="cuda") for t in (q, k, v))
            after.hopper_dkdv(do, q, k, v, lse, delta, dk, dv, dq_acc=dq, dq_scale=scale, **common)
            repeats.append(all(torch.equal(x, y) for x, y in zip((dq, dk, dv), grads["after"])))
        row = dict(input=name, batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d, causal=causal,
                   visible_pairs=pairs, fused_repeats_bitwise_equal=all(repeats),
                   dq_max_diff=(grads["before"][0] - grads["after"][0]).abs().max().item(),
                   dq_max_abs=grads["before"][0].abs().max().item())
        # the backward's 5 GEMMs (the split form runs 7)
        rows.append(ab_row(row, fns, {k_: v_[1:] for k_, v_ in grads.items()}, 2 * 5.0 * d * pairs))
        print(f"   repeats bitwise {all(repeats)}  dq diff {row['dq_max_diff']:.3g} of {row['dq_max_abs']:.3g}",
              flush=True)
    save(args.out, "fused_dq_ab_masked" if args.masked else "fused_dq_ab", rows)


if __name__ == "__main__":
    main()
