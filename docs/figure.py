"""Draws docs/ring-and-merge.svg, the README's picture: `python3 docs/figure.py` (needs matplotlib)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

W = 4
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]


def box(ax, x, y, w, h, text, color, size=9):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02", fc=color, ec="black",
                                lw=0.8, alpha=0.9))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, color="white", weight="bold")


def arrow(ax, a, b, rad=0.0, color="black"):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, lw=1.2, color=color,
                                 connectionstyle=f"arc3,rad={rad}"))


def main() -> None:
    plt.rcParams["svg.hashsalt"] = "ringlse"  # the same file from the same drawing
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: a small file
    fig, (ring, merge) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1, 1.15]})
    for ax in (ring, merge):
        ax.set_xlim(-1.6, 1.6)
        ax.set_ylim(-1.45, 1.45)
        ax.set_aspect("equal")
        ax.axis("off")
    ring.set_title("the ring: K/V blocks travel, queries stay", fontsize=11)
    pos = [(math.cos(math.pi / 2 - 2 * math.pi * r / W), math.sin(math.pi / 2 - 2 * math.pi * r / W)) for r in range(W)]
    for r, (x, y) in enumerate(pos):
        box(ring, x, y, 0.62, 0.42, f"rank {r}\nQ{r}  K/V{r}", COLORS[r], 8)
    for r in range(W):
        (x0, y0), (x1, y1) = pos[r], pos[(r + 1) % W]
        arrow(ring, (x0 * 0.78 + x1 * 0.22, y0 * 0.78 + y1 * 0.22), (x1 * 0.78 + x0 * 0.22, y1 * 0.78 + y0 * 0.22),
              rad=-0.25)
    ring.text(0, 0.05, "step s: rank r attends\nQr to K/V(r - s)\n→ (out, lse) per block", ha="center",
              va="center", fontsize=8.5)
    ring.text(0, -1.38, "backward: dk/dv of each block go home to its owner", ha="center", fontsize=8.5)

    merge.set_title("the merge: exact, in any order", fontsize=11)
    for i, y in enumerate((0.75, 0.0, -0.75)):
        box(merge, -1.05, y, 0.75, 0.45, f"block {i + 1}\n(o{i + 1}, l{i + 1})", COLORS[i], 8)
        arrow(merge, (-0.65, y), (-0.05, 0.0), rad=0.0)
    box(merge, 0.35, 0.0, 0.7, 0.5, "merge", "#555555", 10)
    arrow(merge, (0.72, 0.0), (1.0, 0.0))
    merge.text(1.25, 0.0, "(o, l)", ha="center", va="center", fontsize=10)
    merge.text(0.2, -1.05, r"$l = \log \sum_i e^{l_i}$" + "\n" + r"$o = \sum_i e^{l_i - l}\, o_i$", ha="center",
               va="center", fontsize=11)
    merge.text(0.2, -1.4, "rows that see no key: (0, -inf), never NaN", ha="center", fontsize=8.5)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("ring-and-merge.svg"), metadata={"Date": None})


if __name__ == "__main__":
    main()
