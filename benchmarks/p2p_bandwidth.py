"""Bandwidth of the ring's neighbour exchange (send to rank+1, receive from rank-1), under torchrun:

    torchrun --nproc_per_node=4 benchmarks/p2p_bandwidth.py [--mib 64 128 256]

Prints GB/s per direction for `RingComm.exchange` alone and while a bf16 matmul keeps the GPU busy
(the ring's situation: the transfer hides behind the block kernels only if it is fast enough then).
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from ringlse.ring.comm import RingComm


def timed(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    t = torch.tensor([start.elapsed_time(end) / reps], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mib", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--pieces", type=int, nargs="+", default=[1], help="split each message into this many sends")
    args = p.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    comm = RingComm(None)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul_ms = timed(lambda: a @ a)
    side = torch.cuda.Stream()
    for mib, pieces in [(m, k) for m in args.mib for k in args.pieces]:
        send = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
        recv = torch.empty_like(send)

        def exchange():
            if pieces == 1:
                return comm.exchange(send, recv)
            ops = [op for s_, r_ in zip(send.chunk(pieces), recv.chunk(pieces)) for op in (
                dist.P2POp(dist.isend, s_, comm.next), dist.P2POp(dist.irecv, r_, comm.prev))]
            return dist.batch_isend_irecv(ops)

        alone = timed(lambda: comm.wait(exchange()))

        def busy():
            works = exchange()
            with torch.cuda.stream(side):  # keep the SMs busy meanwhile, as a block kernel would
                for _ in range(4):
                    a @ a
            torch.cuda.current_stream().wait_stream(side)
            comm.wait(works)

        both = timed(busy)
        if comm.rank == 0:
            print(f"{mib:5d} MiB in {pieces}: alone {alone:7.3f} ms = {mib / 1024 / alone * 1e3:6.1f} GiB/s;  "
                  f"with 4 matmuls ({4 * matmul_ms:.2f} ms alone) {both:7.3f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
