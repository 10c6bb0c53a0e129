"""`StateRows`: block calls over row ranges fill a call's float32 state; the first call over rows nothing
has written yet writes them (`fresh`, for ops that can), later ones merge, rows no call wrote come out
`(0, -inf)`. Against a dense-mask float64 oracle written here (the union of the calls' key ranges per
row), for an op that writes fresh rows (`triton`, under the interpreter on CPU) and one that does not
(`torch`, float64)."""

from __future__ import annotations

import pytest
import torch

from ringlse.blocks import get_block_op
from ringlse.blocks.contract import StateRows
from ringlse.testing import assert_judged

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

B, S, H, D = 1, 40, 2, 16

# (q0, q1, k0, k1) per call; a row's calls see disjoint keys, so the oracle is one softmax over their union
PLANS = [
    pytest.param([(0, S, 0, S)], id="one-call"),
    pytest.param([(0, S, 0, 16), (0, S, 16, S)], id="same-rows-twice"),
    pytest.param([(0, 24, 0, 10), (10, S, 10, 30)], id="overlapping-rows"),
    pytest.param([(5, 12, 0, 8), (20, 31, 8, S)], id="rows-left-unwritten"),
    pytest.param([(10, 20, 0, 5), (0, S, 5, 9), (30, S, 9, S)], id="gap-filled-before-a-merge"),
    pytest.param([], id="no-call"),
]


def oracle(q, k, v, plan, scale):
    """`(out, lse)` in float64 over the dense mask of `plan`: row i sees key j iff a call covers (i, j)."""
    mask = torch.zeros(S, S, dtype=torch.bool)
    for q0, q1, k0, k1 in plan:
        mask[q0:q1, k0:k1] = True
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: p = 0, out = 0
    return torch.einsum("bhij,bjhd->bihd", p, v.double()), lse


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("backend, dtype", [("triton", torch.float32), ("torch", torch.float64)],
                         ids=["triton-fp32", "torch-fp64"])
def test_state_rows_match_the_dense_oracle(plan, backend, dtype):
    if backend == "triton":
        pytest.importorskip("triton")
    op = get_block_op(backend, "cpu", dtype)
    assert op.caps.writes_fresh == (backend == "triton")
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    scale = D**-0.5
    state = StateRows(q.shape, dtype, q.device)
    # whatever the accumulators held before is never read: NaN where a fresh call writes
    state.out.fill_(float("nan"))
    state.lse.fill_(float("nan"))
    for q0, q1, k0, k1 in plan:
        state.add(op, q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], q0, q1, softmax_scale=scale, causal=False,
                  q_start=0, k_start=0)
    out, lse = state.result()
    ref_o, ref_l = oracle(q, k, v, plan, scale)
    assert not out.isnan().any() and not lse.isnan().any()
    assert_judged("out", out, ref_o, None, dtype)
    assert_judged("lse", lse, ref_l, None, dtype, is_lse=True)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
