"""Verify ring attention against full softmax attention, forward and backward, on whatever exists.

    torchrun --nproc_per_node=N launch/verify.py [flags]   # one rank per process (NCCL with CUDA, else gloo)
    python launch/verify.py [flags]                        # starts the ranks itself: one per GPU, else 2 CPU ranks

Every rank builds the same random full-sequence inputs, runs `ring_attention` on its shard, and rank 0
compares the gathered out, lse, dq, dk, dv with the float64 `reference_attention` on the full sequence by
CONVENTIONS.md §7, printing a table. Exit code 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ringlse
from ringlse.testing import judge_all, ring_with_grads

BACKENDS = ("triton", "sdpa", "flash", "fa4", "fa2", "torch")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected L,R (two integers, -1 unbounded), got {text!r}") from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"window entries must be >= -1, got {text!r}")
    return left, right


def document_bounds(seqlen: int, n_docs: int | None, seed: int) -> list[int] | None:
    """`n_docs` documents of random lengths over the sequence (boundaries), the same on every rank."""
    if n_docs is None:
        return None
    gen = torch.Generator().manual_seed(seed + 1)
    cuts = torch.randperm(seqlen - 1, generator=gen)[: n_docs - 1] + 1 if seqlen > 1 else torch.empty(0)
    return [0, *sorted(int(c) for c in cuts), seqlen]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=_positive, default=1)
    p.add_argument("--seqlen", type=_positive, default=None,
                   help="total sequence length (default: about 4096 on GPU, 256 on CPU, rounded up to divide "
                        "over the ranks in the chosen layouts)")
    p.add_argument("--heads", type=_positive, default=8)
    p.add_argument("--kv-heads", type=_positive, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=_positive, default=64)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--layout", choices=ringlse.ring.layout.LAYOUT_NAMES, default=None,
                   help="default: zigzag when causal, contiguous otherwise; balanced needs --docs")
    p.add_argument("--backend", choices=("auto", *BACKENDS), default="auto")
    p.add_argument("--window", type=_window, default=(-1, -1), metavar="L,R",
                   help="sliding window: each query sees keys from L before to R after it (-1: unbounded)")
    p.add_argument("--docs", type=_positive, default=None, metavar="N",
                   help="pack N documents of random lengths into the sequence (attention stays within each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=_positive, default=None, help="ranks to start without torchrun (default: #GPUs, else 2)")
    p.add_argument("--cpu", action="store_true", help="use CPU ranks (gloo) even when GPUs exist")
    args = p.parse_args(argv)
    if args.heads % (args.kv_heads or args.heads):
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.layout == "balanced" and args.docs is None:
        p.error("--layout balanced places tokens by the documents: give --docs N")
    return args


def layouts_of(args: argparse.Namespace) -> list[tuple[bool, str]]:
    """The (causal, layout) pairs the run verifies."""
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return [(c, args.layout or ringlse.ring.default_layout(c)) for c in causals]


def settle_seqlen(args: argparse.Namespace, world: int, gpu: bool) -> str | None:
    """Fill in the default `args.seqlen` (the smallest length >= 4096 on GPU, 256 on CPU, that every
    layout of the run divides over `world` ranks), or say in one line why the given one cannot run."""
    if args.seqlen is None:
        base = 4096 if gpu else 256
        args.seqlen = next(n for n in range(base, base + 64 * world + 1)  # balanced: 64·W
                           if all(_fits(layout, n, world) for _, layout in layouts_of(args)))
        return None
    for _, layout in layouts_of(args):
        try:
            ringlse.ring.layout.check_layout(layout, args.seqlen, world)
        except ValueError as e:
            return f"--seqlen: {e}"
    return None


def _fits(layout: str, seqlen: int, world: int) -> bool:
    try:
        ringlse.ring.layout.check_layout(layout, seqlen, world)
    except ValueError:
        return False
    return True


def run(args: argparse.Namespace) -> bool:
    """The verification on an initialised process group; returns True iff every check passes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    use_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    seqlen = args.seqlen
    hkv = args.kv_heads or args.heads
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(args.seed)  # same inputs on every rank

    def draw(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = draw(args.batch, seqlen, args.heads, args.head_dim), *(draw(args.batch, seqlen, hkv, args.head_dim) for _ in "kv")
    dout = draw(args.batch, seqlen, args.heads, args.head_dim)
    ok = True
    docs = document_bounds(seqlen, args.docs, args.seed)
    mask = dict(window_size=args.window, cu_seqlens=docs)
    if rank == 0:
        print(f"ring_attention vs float64 reference: W={world} ({'NCCL' if use_cuda else 'gloo'}, {device.type}), "
              f"batch {args.batch}, seqlen {seqlen}, heads {args.heads}/{hkv}, head dim {args.head_dim}, "
              f"{args.dtype}, backend {args.backend}"
              + (f", window {args.window}" if args.window != (-1, -1) else "")
              + (f", {len(docs) - 1} documents {docs}" if docs else ""))
    for causal, layout in layouts_of(args):
        ours = ring_with_grads(q, k, v, dout, causal=causal, layout=layout, backend=args.backend, **mask)
        if rank == 0:
            try:
                verdicts = judge_all(ours, q, k, v, dout, causal=causal, **mask)
            except Exception:  # e.g. the float64 reference does not fit: a FAIL, not a hang of the others
                traceback.print_exc()
                verdicts = []
                ok = False
            print(f"\ncausal={causal}  layout={layout}")
            for vd in verdicts:
                print("  " + str(vd))
            ok &= bool(verdicts) and all(vd.ok for vd in verdicts)
        del ours
    flag = torch.tensor([int(ok)], device=device)
    dist.broadcast(flag, 0)  # every rank exits with rank 0's verdict, which it always sends
    if rank == 0:
        print("\nPASS" if flag.item() else "\nFAIL")
    return bool(flag.item())


def _rank_main(rank: int, world: int, rdzv: str, backend: str, args: argparse.Namespace, codes) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        ringlse.tune_nccl_env()
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    timeout = datetime.timedelta(minutes=5)
    dist.init_process_group(backend, init_method=rdzv, rank=rank, world_size=world, timeout=timeout,
                            pg_options=ringlse.nccl_options(timeout) if backend == "nccl" else None)
    try:
        codes[rank] = 0 if run(args) else 1
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    backend = "nccl" if gpu else "gloo"
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc or (torch.cuda.device_count() if gpu else 2)
    problem = settle_seqlen(args, world, gpu)
    if problem is not None:  # one line, from one rank, before any process group exists
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"verify.py: error: {problem}", file=sys.stderr)
        return 2
    if torchrun:
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            ringlse.tune_nccl_env()
        timeout = datetime.timedelta(minutes=5)
        dist.init_process_group(backend, timeout=timeout, pg_options=ringlse.nccl_options(timeout) if gpu else None)
        try:
            return 0 if run(args) else 1
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        codes = mp.get_context("spawn").Manager().dict()
        mp.spawn(_rank_main, args=(world, f"file://{tmp}/rdzv", backend, args, codes), nprocs=world, join=True)
        return max(codes.values(), default=1)


if __name__ == "__main__":
    sys.exit(main())
