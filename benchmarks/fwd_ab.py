"""A/B of the Hopper forward kernel in one process: a former version (a copy of
`kernels/attention_fwd_hopper.py`, e.g. `git show REV:kernels/attention_fwd_hopper.py > FILE`) against the
installed one, on masked_attention.py's inputs (b1 h32 d128 bf16, S 32K; the plain causal batches with the
same pairs) and issue 32's dense blocks (d 64 and 128, causal and not). The two (and any `--variants`
of the installed kernel) are timed with their launches interleaved (medians), and their outputs compared.
With `--accum`, the in-kernel merge into a float32 running state (the ring's forward; both sides from the
same state), and the installed kernel's plain forward as variant "plain".

Usage (on a GPU): python benchmarks/fwd_ab.py --before FILE [--out DIR] [--seqlen S] [--accum] [--dense]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from block_attention import save_result  # noqa: E402
from timing import interleaved_ms  # noqa: E402
from masked_probe import cases  # noqa: E402


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


DENSE = ((2, 16, 8192, 128), (2, 16, 8192, 64), (1, 32, 16384, 64))  # (batch, heads, seqlen, head dim)


def all_cases(s: int, mask_keys=("causal", "key_lo", "key_hi"), dense=DENSE
              ) -> list[tuple[str, int, int, int, int, dict, int]]:
    """(name, batch, seqlen, heads, head dim, mask kwargs among `mask_keys`, visible pairs per head)."""
    out = [(name, b, sb, 32, 128, {k_: v_ for k_, v_ in mask.items() if k_ in mask_keys}, pairs)
           for name, b, sb, mask, pairs in cases(s)]
    for b, h, sd, d in dense:
        for causal in (False, True):
            pairs = b * (sd * (sd + 1) // 2 if causal else sd * sd)
            out.append((f"dense b{b} h{h} s{sd} d{d} {'causal' if causal else 'full'}", b, sd, h, d,
                        dict(causal=causal), pairs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a former attention_fwd_hopper.py")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--variants", default="", help="also the installed kernel with these configs, e.g. "
                    "'128:0,192:1' (block_m:persistent; 192 only at head dim 64)")
    ap.add_argument("--accum", action="store_true", help="the merging forward (float32 state)")
    ap.add_argument("--dense", action="store_true", help="only the dense blocks (no masked inputs)")
    ap.add_argument("--also", action="append", default=[], help="another attention_fwd_hopper.py copy to time "
                    "(repeatable; named by its file's stem)")
    args = ap.parse_args()
    from ringlse.kernels import attention_fwd_hopper as after

    before = load_module(args.before, "attention_fwd_hopper_before")
    also = {os.path.splitext(os.path.basename(p))[0]: load_module(p, f"also_{i}") for i, p in enumerate(args.also)}
    rows = []
    for name, b, s, h, d, mask, pairs in all_cases(args.seqlen):
        if args.dense and not name.startswith("dense"):
            continue
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        outs = {}
        fns = {}
        state = (torch.randn(b, s, h, d, device="cuda"), torch.randn(b, h, s, device="cuda"))
        for side, mod in (("before", before), ("after", after), *also.items()):
            o = state[0].clone() if args.accum else torch.empty_like(q)
            lse = state[1].clone() if args.accum else torch.empty(b, h, s, dtype=torch.float32, device="cuda")

            def fn(_i, mod=mod, o=o, lse=lse):
                mod.hopper_forward(q, k, v, o, lse, softmax_scale=d**-0.5, offset=0, accum=args.accum, **mask)
            fn(0)
            outs[side] = (o.clone(), lse.clone())  # (the merging calls go on changing o and lse)
            fns[side] = fn
        if args.accum:
            o, lse = torch.empty_like(q), torch.empty(b, h, s, dtype=torch.float32, device="cuda")
            fns["plain"] = lambda _i: after.hopper_forward(q, k, v, o, lse, softmax_scale=d**-0.5, offset=0,
                                                           accum=False, **mask)
            fns["plain"](0)
            outs["plain"] = (o, lse)
        for var in filter(None, args.variants.split(",")):
            bm, pers = (int(x) for x in var.split(":"))
            if bm == 192 and (d != 64 or "key_lo" in mask):
                continue
            o = torch.empty_like(q)
            lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")

            def fn(_i, o=o, lse=lse, cfg=after.HopperConfig(bm, bool(pers))):
                after.hopper_forward(q, k, v, o, lse, softmax_scale=d**-0.5, offset=0, accum=False, config=cfg, **mask)
            fn(0)
            outs[var] = (o, lse)
            fns[var] = fn
        rows.append(ab_row(dict(input=name, batch=b, seqlen=s, heads=h, head_dim=d, visible_pairs=pairs), fns, outs,
                           4.0 * h * d * pairs))
    save(args.out, "fwd_ab_accum" if args.accum else "fwd_ab", rows)


def max_diff(x: tuple[torch.Tensor, ...], y: tuple[torch.Tensor, ...]) -> float:
    """Largest absolute difference between two sides' outputs (`-inf` lse rows count as equal)."""
    return max((a.float() - b.float()).nan_to_num(0.0).abs().max().item() for a, b in zip(x, y))


def ab_row(row: dict, fns: dict, outs: dict, flop: float) -> dict:
    """Time `fns` ("before", "after", then any variants) with their launches interleaved
    (`interleaved_ms`), and add their median times, TFLOP/s (`flop` per call), speedups over "before" and
    output differences to `row`; prints it."""
    torch.cuda.synchronize()
    ms = interleaved_ms(fns)
    row.update(max_abs_diff=max_diff(outs["before"], outs["after"]), before_ms=ms["before"], after_ms=ms["after"])
    row["before_tflops"] = flop / row["before_ms"] / 1e9
    row["after_tflops"] = flop / row["after_ms"] / 1e9
    row["speedup"] = row["before_ms"] / row["after_ms"]
    for var in [x for x in fns if x not in ("before", "after")]:
        row[f"variant_{var}_diff"] = max_diff(outs["before"], outs[var])
        row[f"variant_{var}_ms"] = ms[var]
        row[f"variant_{var}_speedup"] = row["before_ms"] / row[f"variant_{var}_ms"]
    print(f"{row['input']:<34} diff {row['max_abs_diff']:.3g}  before {row['before_tflops']:6.1f}  after "
          f"{row['after_tflops']:6.1f}  x{row['speedup']:.3f}" + "".join(
              f"  {k_[8:-8]} x{v_:.3f}" for k_, v_ in row.items()
              if k_.startswith("variant_") and k_.endswith("_speedup")), flush=True)
    return row


def save(out_dir: str | None, stem: str, rows: list[dict]) -> None:
    import triton

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "command": " ".join(sys.argv), "rows": rows}
    if out_dir:
        print(save_result(out_dir, stem, result))


if __name__ == "__main__":
    main()
