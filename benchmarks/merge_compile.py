"""Compile the merge kernels for sm_90 on a machine without a GPU and print ptxas's registers and spills.

Triton's driver is replaced by a fake one (`block_attention._install_fake_driver`): launches only compile.
Covers the four-slot, stacked and tuple kernels at N = 1-16 (bf16, both lse bases), the small row tiles
the launcher picks for few rows, and the ring's in-place update.

Usage: python benchmarks/merge_compile.py [SUBSTRING]   (only the cases whose name contains it)
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from block_attention import _install_fake_driver, _ptxas_report  # noqa: E402


def cases(km, t=64, h=32, d=128):
    bf = torch.bfloat16
    out, ol = torch.empty(t, h, d, dtype=bf), torch.empty(t, h)
    for base2 in (False, True):
        for n in (1, 2, 3, 4, 5, 8, 16):
            v, s = torch.empty(t, n, h, d, dtype=bf), torch.empty(t, n, h)
            if n <= km.MAX_STATES_PER_LAUNCH:
                yield f"slots n{n} base2={base2}", lambda v=v, s=s, b=base2: km._launch(
                    list(v.unbind(1)), [x.mT for x in s.unbind(1)], out, ol.mT, None, None, b)
            for rows, warps in ((None, None), (1, 1), (4, 2), (32, 8)):
                yield f"stacked n{n} rows{rows} warps{warps} base2={base2}", (
                    lambda v=v, s=s, n=n, b=base2, r=rows, w=warps: km._launch_stacked(
                        n, v[:, 0], s[:, 0].mT, v.stride(1), s.stride(1), out, ol.mT, r, w, b))
            if n > km.MAX_STATES_PER_LAUNCH:
                outs = [torch.empty(t, h, d, dtype=bf if i % 3 else torch.float32) for i in range(n)]
                lses = [torch.empty(h, t) for _ in range(n)]
                yield f"tuple n{n} mixed dtypes base2={base2}", lambda o=outs, l=lses, b=base2: km._launch_tuple(
                    o, l, out, ol.mT, None, None, b)
    o32, l32, blk = torch.empty(1, t, h, d), torch.empty(1, h, t), torch.empty(1, t, h, d, dtype=bf)
    yield "update_state_ in place", lambda: km.update_state_(o32, l32, blk, l32.clone())


def main() -> None:
    compiled = _install_fake_driver(90)
    import ringlse.kernels.merge as km

    only = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, fn in cases(km):
        if only not in name:
            continue
        before = len(compiled)
        fn()
        for kname, k, dt in compiled[before:]:
            print(f"{name:<44} {kname:<24} {_ptxas_report(k)}  {dt:.1f}s", flush=True)


if __name__ == "__main__":
    main()
