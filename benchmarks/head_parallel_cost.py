"""An alpha-beta cost model of head parallelism x ring (U = 8 GPUs of a node x a ring of R nodes) against
a flat ring of 8R GPUs: causal attention fwd+bwd, batch 1, 32 heads x d 128, bf16. Prints the table of
docs/head-parallel-cost.md (`--check`: exit 1 unless the doc holds it as printed).

    python3 benchmarks/head_parallel_cost.py [--check]

Model (per GPU; every GPU of a phase works alike, zigzag balances causal work):
- kernels run at the measured block rates of `results/block_attention-NVIDIA_H100_80GB_HBM3.json`
  (mean over its d 128 MHA rows at S >= 8K, causal or not: a ring step's blocks are of both kinds);
  fwd+bwd FLOPs are 3.5x the forward's (CONVENTIONS.md §8), so the work is perfectly divided;
- a ring of n ranks runs n steps per pass; each step's K/V (forward; plus float32 dk/dv going home in
  the backward: 3x the bytes) moves while the previous block is attended, so a pass takes
  `c + (n - 1) * max(c, alpha + bytes / beta)` with c the compute of one step;
- within a node (NVLink): beta 450 GB/s per direction per GPU, alpha 10 us; across nodes (400 Gb/s per
  GPU's NIC): beta 50 GB/s, alpha 20 us. A flat ring across nodes waits each step for the transfer that
  crosses a node boundary; the hybrid's rings cross nodes at every step, each GPU over its own NIC;
- the hybrid's four all-to-alls (q/k/v in and out/lse back, dout/dlse in and dq/dk/dv back; (U - 1)/U of
  each leaving the GPU) are not overlapped: their time adds.
Efficiency = (compute alone) / (modelled time), as CONVENTIONS.md §8's ring efficiency with a perfect
one-GPU kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "head-parallel-cost.md"
BLOCKS = HERE / "results" / "block_attention-NVIDIA_H100_80GB_HBM3.json"
BEGIN, END = "<!-- head_parallel_cost.py: begin -->", "<!-- head_parallel_cost.py: end -->"


@dataclass(frozen=True)
class Link:
    alpha_s: float
    beta_bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_per_s


NVLINK = Link(10e-6, 450e9)
NETWORK = Link(20e-6, 50e9)


@dataclass(frozen=True)
class Shape:
    tokens_per_gpu: int
    kv_heads: int = 32
    heads: int = 32
    head_dim: int = 128
    bytes_per_value: int = 2  # bf16

    def kv_bytes(self) -> float:
        """One rank's K/V block (a ring step's message): 2 x t x h_kv x d values."""
        return 2 * self.tokens_per_gpu * self.kv_heads * self.head_dim * self.bytes_per_value

    def all_to_all_bytes(self, heads_ranks: int) -> float:
        """What one GPU sends in the hybrid's four all-to-alls (q/k/v, out, dout, dq/dk/dv: 4 h + 4 h_kv
        head rows of t tokens; lse rows are d times smaller and left out), (U - 1)/U of it leaving."""
        rows = 4 * self.heads + 4 * self.kv_heads
        return rows * self.tokens_per_gpu * self.head_dim * self.bytes_per_value * (heads_ranks - 1) / heads_ranks


def kernel_rates(path: Path = BLOCKS) -> tuple[float, float]:
    """(forward, backward) FLOP/s of the block kernels: the mean over the file's d 128 MHA rows at S >= 8K."""
    rows = [r for r in json.loads(path.read_text())["rows"]
            if r["head_dim"] == 128 and r["kv_heads"] == r["heads"] and r["seqlen"] >= 8192]
    mean = lambda key: sum(r[key] for r in rows) / len(rows) * 1e12  # noqa: E731
    return mean("ours_fwd_tflops"), mean("ours_bwd_tflops")


def compute_s(shape: Shape, gpus: int, rates: tuple[float, float]) -> tuple[float, float]:
    """(forward, backward) seconds of one GPU's share of causal attention over S = gpus x t tokens."""
    s = gpus * shape.tokens_per_gpu
    fwd_flop = 4 * shape.heads * s * s * shape.head_dim / 2 / gpus
    return fwd_flop / rates[0], 2.5 * fwd_flop / rates[1]


def ring_pass_s(compute: float, steps: int, link: Link, nbytes: float) -> float:
    """A pass of `steps` ring steps (compute of all of them `compute`), each transfer behind a step."""
    c = compute / steps
    return c + (steps - 1) * max(c, link.seconds(nbytes)) if steps > 1 else compute


def flat_ring(shape: Shape, nodes: int, rates, gpus_per_node: int = 8) -> float:
    """Efficiency of a flat ring over `nodes` x 8 GPUs."""
    gpus = nodes * gpus_per_node
    fwd, bwd = compute_s(shape, gpus, rates)
    link = NVLINK if nodes == 1 else NETWORK
    kv = shape.kv_bytes()
    time = ring_pass_s(fwd, gpus, link, kv) + ring_pass_s(bwd, gpus, link, 3 * kv)
    return (fwd + bwd) / time


def hybrid(shape: Shape, nodes: int, rates, heads_ranks: int = 8) -> float:
    """Efficiency of U = 8 GPUs of a node x a ring of `nodes` (each ring step's block: U·t tokens of
    h/U heads, the same bytes as a flat ring's block of t tokens of h heads)."""
    gpus = nodes * heads_ranks
    fwd, bwd = compute_s(shape, gpus, rates)
    kv = shape.kv_bytes()
    all_to_all = 4 * NVLINK.alpha_s + shape.all_to_all_bytes(heads_ranks) / NVLINK.beta_bytes_per_s
    time = all_to_all + ring_pass_s(fwd, nodes, NETWORK, kv) + ring_pass_s(bwd, nodes, NETWORK, 3 * kv)
    return (fwd + bwd) / time


def crossover_tokens(kv_heads: int, rates, link: Link = NETWORK, heads: int = 32) -> float:
    """Tokens per ring rank from which a ring step's compute hides its transfer (alpha left out), forward
    and backward alike: 2·h·t²·d / F_fwd >= 4·t·h_kv·d / beta and 5·h·t²·d / F_bwd >= 12·t·h_kv·d / beta
    (bytes: bf16 K/V forward, plus float32 dk/dv backward)."""
    fwd, bwd = rates
    return max(2 * kv_heads * fwd, 2.4 * kv_heads * bwd) / (heads * link.beta_bytes_per_s)


def table(rates=None) -> str:
    """The markdown table of efficiencies, nodes 1-16 x tokens per GPU 8K-32K, MHA 32/32 and GQA 32/8."""
    rates = rates or kernel_rates()
    lines = ["| nodes (GPUs) | tokens per GPU | S | MHA: flat ring | MHA: U = 8 x R | GQA 32/8: flat ring | "
             "GQA 32/8: U = 8 x R |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for nodes in (1, 2, 4, 8, 16):
        for t in (8192, 16384, 32768):
            cells = []
            for kv_heads in (32, 8):
                shape = Shape(t, kv_heads)
                flat, hyb = flat_ring(shape, nodes, rates), hybrid(shape, nodes, rates)
                cells += [f"**{flat:.2f}**" if flat > hyb + 0.005 else f"{flat:.2f}",
                          f"**{hyb:.2f}**" if hyb > flat + 0.005 else f"{hyb:.2f}"]
            lines.append(f"| {nodes} ({8 * nodes}) | {t // 1024}K | {8 * nodes * t // 1024}K | {' | '.join(cells)} |")
    fwd, bwd = rates
    lines.append("")
    lines.append(f"A ring step hides its transfer across nodes from {crossover_tokens(32, rates) / 1024:.1f}K tokens "
                 f"per ring rank (MHA) or {crossover_tokens(8, rates) / 1024:.1f}K (GQA 32/8); a U = 8 x R ring "
                 "rank holds U x the tokens per GPU.")
    lines.append("")
    lines.append("Bold: the better of the two by more than 0.005. ")
    lines[-1] += (f"Kernel rates used: forward {fwd / 1e12:.0f} TFLOP/s, backward {bwd / 1e12:.0f} TFLOP/s "
                 f"(`{BLOCKS.relative_to(HERE.parent)}`).")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 unless docs/head-parallel-cost.md holds the table")
    args = p.parse_args()
    text = table()
    if not args.check:
        print(text)
        return 0
    doc = DOC.read_text(encoding="utf-8")
    held = doc.split(BEGIN, 1)[1].split(END, 1)[0].strip() if BEGIN in doc and END in doc else None
    if held != text:
        print(f"{DOC} does not hold the table this model prints; paste it between the markers:\n\n{text}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
