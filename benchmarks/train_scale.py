"""Long-context training end to end: ringlse's ring next to PyTorch context parallel on the same model,
ranks and tokens (`launch/train.py --scale` runs, one torchrun per configuration).

    python3 benchmarks/train_scale.py --model llama-8b --tokens 65536 131072 [--documents] [--longest]
    python3 benchmarks/train_scale.py --model llama-1b --exactness --tokens 32768 --steps 50

Table mode times each tokens-per-step with `--attention ringlse` and `torch-cp` (one causal sequence per
step), with `--documents` adds ringlse over packed documents (balanced layout), and with `--longest` doubles
the tokens per step from the largest until a run does not fit (out of memory, reported). Exactness mode
trains the same model on one GPU and on `--nproc` GPUs from the same weights and batches and compares the
loss curves. `--dp G` splits the ranks into G data-parallel rings, each on its own sequence. Writes `train-<model>-<N>x<gpu>.json` (records with `model`, `attention`, `tokens_per_step`,
`tokens_per_s_per_gpu`, `mfu`, `peak_mem_gib`, `fits`, `documents`) and a PNG to `--out`, after every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# torch CP's SDPA path takes no document mask (a FlexAttention document mask under CP is not wired here)
CP_DOCUMENTS = "not run: PyTorch context parallel's SDPA path takes no document mask"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("tiny", "llama-1b", "llama-8b"), default="llama-8b")
    p.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--dp", type=int, default=1, help="data-parallel groups, each a ring of nproc / dp ranks")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--documents", action="store_true", help="also ringlse over packed documents")
    p.add_argument("--only-documents", action="store_true", help="only the packed-documents rows")
    p.add_argument("--longest", action="store_true", help="double the tokens until a run does not fit")
    p.add_argument("--longest-cap", type=int, default=1 << 21, help="stop doubling here")
    p.add_argument("--only-longest", action="store_true",
                   help="no table: double from the largest --tokens (taken as fitting)")
    p.add_argument("--exactness", action="store_true", help="one GPU vs --nproc GPUs, loss curves")
    p.add_argument("--tolerance", type=float, default=2e-2, help="exactness: largest allowed |loss difference|")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--backend", default="auto", help="ringlse's block op (auto, triton, fa4, ...); torch-cp runs SDPA")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more launch/train.py flags")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return p.parse_args(argv)


def run_one(args, attention: str, tokens: int, documents: bool, nproc: int, steps: int, warmup: int) -> dict:
    """One `launch/train.py --scale` under torchrun: its record, or `fits: False` with the reason."""
    base = dict(model=args.model, attention=attention, tokens_per_step=tokens, documents=documents, world=nproc)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["torchrun", f"--nproc_per_node={nproc}", str(ROOT / "launch" / "train.py"), "--scale",
               "--model", args.model, "--attention", attention, "--tokens", str(tokens), "--steps", str(steps),
               "--warmup", str(warmup), "--out", tmp, *(["--documents"] if documents else []),
               # one GPU takes every data-parallel group's sequence
               *(["--dp", str(args.dp)] if nproc > 1 else ["--sequences", str(args.dp)]),
               *(["--backend", args.backend] if attention == "ringlse" else []), *args.extra]
        print(" ".join(cmd[1:]), flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return dict(base, fits=False, reason=f"timed out after {args.timeout:.0f} s")
        found = list(Path(tmp).glob("scale-*.json"))
        if proc.returncode == 0 and found:
            record = json.loads(found[0].read_text())
            print(f"  {record['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, MFU {record['mfu']}, peak "
                  f"{record['peak_mem_gib']:.1f} GiB", flush=True)
            return record
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        oom = "out of memory" in proc.stderr
        errors = [ln for ln in lines if "Error:" in ln and "ChildFailedError" not in ln]
        reason = "out of memory" if oom else (errors or lines or ["?"])[-1]
        print(f"  did not run: {reason}", flush=True)
        return dict(base, fits=False, reason=str(reason)[:300], stderr_tail=proc.stderr[-2000:] if not oom else None)


def environment() -> dict:
    import torch

    return dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                gpus=torch.cuda.device_count(), torch=torch.__version__, command=" ".join(sys.argv),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def save(args, env: dict, records: list[dict], extra: dict) -> Path:
    from ring import gpu_name_tag

    tag = gpu_name_tag(env["gpu"])
    path = args.out / f"train-{args.model}-{args.nproc}x{tag}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(env, records=records, **extra), indent=1))
    plot(records, extra, path.with_suffix(".png"), f"{args.model}, {args.nproc}x {tag}")
    return path


def plot(records: list[dict], extra: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = extra.get("exactness")
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(11 if curves else 6, 3.8), squeeze=False)
    ax = axes[0][0]
    timed = [r for r in records if r.get("fits") and r.get("world", 0) > 1]
    labels = sorted({(r["attention"], r["documents"], r.get("backend")) for r in timed}, key=str)
    sizes = sorted({r["tokens_per_step"] for r in timed})
    width = 0.8 / max(len(labels), 1)
    for i, (att, docs, backend) in enumerate(labels):
        vals = [next((r["tokens_per_s_per_gpu"] for r in timed if r["attention"] == att and r["documents"] == docs
                      and r.get("backend") == backend and r["tokens_per_step"] == s), 0) for s in sizes]
        ring = f" ({backend} ring)" if att == "ringlse" and backend else ""
        ax.bar([j + i * width for j in range(len(sizes))], vals, width, label=att + ring + (", documents" if docs else ""))
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(sizes))], [f"{s // 1024}K" for s in sizes])
    ax.set(xlabel="tokens per step", ylabel="tokens/s per GPU", title=title)
    ax.legend(fontsize=8)
    if curves:
        ax = axes[0][1]
        for name, losses in curves["losses"].items():
            ax.plot(losses, label=name)
        ax.set(xlabel="step", ylabel="loss", title=f"{curves['tokens']} tokens per step, max |diff| "
               f"{curves['max_abs_diff']:.2e}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = environment()
    records: list[dict] = []
    extra: dict = {}
    if args.exactness:
        tokens = args.tokens[0]
        one = run_one(args, "ringlse", tokens, False, 1, args.steps, args.warmup)
        many = run_one(args, "ringlse", tokens, False, args.nproc, args.steps, args.warmup)
        records += [one, many]
        if one.get("fits") and many.get("fits"):
            diff = max(abs(a - b) for a, b in zip(one["losses"], many["losses"]))
            extra["exactness"] = dict(tokens=tokens, steps=args.steps, max_abs_diff=diff, tolerance=args.tolerance,
                                      passed=diff <= args.tolerance, losses={"one GPU": one["losses"],
                                                                             f"{args.nproc} GPUs, ring": many["losses"]})
            print(f"exactness: max |loss difference| {diff:.2e} over {args.steps} steps (tolerance "
                  f"{args.tolerance:g})")
        save(args, env, records, extra)
        return 0
    for tokens in [] if args.only_longest else args.tokens:
        for attention in () if args.only_documents else ("ringlse", "torch-cp"):
            records.append(run_one(args, attention, tokens, False, args.nproc, args.steps, args.warmup))
            save(args, env, records, extra)
        if args.documents or args.only_documents:
            records.append(run_one(args, "ringlse", tokens, True, args.nproc, args.steps, args.warmup))
            records.append(dict(model=args.model, attention="torch-cp", tokens_per_step=tokens, documents=True,
                                world=args.nproc, fits=None, reason=CP_DOCUMENTS))
            save(args, env, records, extra)
    if args.longest:
        extra["longest"], extra["longest_cap"] = {}, args.longest_cap
        for attention in ("ringlse", "torch-cp"):
            fitted = [r["tokens_per_step"] for r in records if r["attention"] == attention and r.get("fits")]
            fitted += [max(args.tokens)] if args.only_longest else []
            if not fitted:
                continue
            best = max(fitted)
            tokens = best * 2
            while tokens <= args.longest_cap:
                r = run_one(args, attention, tokens, False, args.nproc, 2, 1)
                records.append(dict(r, probe="longest"))
                if not r.get("fits"):
                    break
                best, tokens = tokens, tokens * 2
            extra["longest"][attention] = best
            save(args, env, records, extra)
    path = save(args, env, records, extra)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
