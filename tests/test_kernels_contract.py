"""The kernel layer's own contract (`ringlse.kernels`): plain arguments, edge cases of the block contract,
and the interpreter switch.

`attention_forward` / `attention_backward` take blocks the caller has classified (nothing visible:
not passed; `causal=True` only where the causal boundary crosses the block). These tests pin down what
the launchers still guarantee outside that: zero-length q or k, `causal=True` on a block every query
sees (bit for bit the non-causal result), a causal block no query sees (`(0, -inf)` rows,
accumulators kept up to a rounding, gradients untouched), and `fresh` accumulators (written, not read). float32 under the interpreter on CPU (conftest sets TRITON_INTERPRET=1 without
CUDA), against `reference_attention` in float64.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ringlse import reference_attention
from ringlse.testing import assert_judged

pytest.importorskip("triton")
from ringlse.kernels.attention_bwd import attention_backward, attention_delta  # noqa: E402
from ringlse.kernels.attention_fwd import attention_forward  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EPS32 = torch.finfo(torch.float32).eps
# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim): GQA, a padded head dim, several tiles
B, SQ, SK, H, HKV, D = 2, 37, 45, 4, 2, 40


def _draw(sq, sk, device, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, sq, H, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(B, sk, HKV, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(B, sk, HKV, D, generator=g).to(device=device, dtype=dtype)
    return q, k, v


def _state(sq, device, seed=1):
    """A running state with some rows that have seen nothing (lse -inf, out garbage but finite)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(B, sq, H, D, generator=g).to(device)
    lse = (torch.randn(B, H, sq, generator=g) * 3).to(device)
    lse[:, :, ::4] = float("-inf")
    return out, lse


def _forward(q, k, v, causal, q_start, k_start, state=None):
    kw = dict(softmax_scale=D**-0.5, causal=causal, q_start=q_start, k_start=k_start)
    if state is None:
        return attention_forward(q, k, v, **kw)
    out_acc, lse_acc = (t.clone() for t in state)
    return attention_forward(q, k, v, out_acc=out_acc, lse_acc=lse_acc, **kw)


def _backward(q, k, v, causal, q_start, k_start, seed=2):
    """Gradients added into random accumulators: `(before, after)` for dq, dk, dv."""
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(q.shape, generator=g).to(q.device)
    lse = torch.randn(B, H, q.shape[1], generator=g).to(q.device) + 3.0
    delta = attention_delta(dout, dout)
    before = [torch.randn(t.shape, generator=g).to(q.device) for t in (q, k, v)]
    after = [t.clone() for t in before]
    attention_backward(dout, q, k, v, dout, lse, delta, softmax_scale=D**-0.5, causal=causal, q_start=q_start,
                       k_start=k_start, dq_acc=after[0], dk_acc=after[1], dv_acc=after[2])
    return before, after


# ---------------------------------------------------------------------------------------------------
# zero-length q or k: nothing is launched


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_length_k(causal, device):
    q, k, v = _draw(SQ, 0, device)
    out, lse = _forward(q, k, v, causal, 0, 0)
    ref_o, ref_l = reference_attention(q.double(), k.double(), v.double(), causal=causal, q_start=0, k_start=0)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (B, H, SQ) and lse.dtype == torch.float32
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert torch.equal(out.double(), ref_o) and torch.equal(lse.double(), ref_l.double())
    # accumulators: untouched, even the rows that have seen nothing yet
    state = _state(SQ, device)
    out_acc, lse_acc = _forward(q, k, v, causal, 0, 0, state)
    assert torch.equal(out_acc, state[0]) and torch.equal(lse_acc, state[1])
    before, after = _backward(q, k, v, causal, 0, 0)
    for b_, a in zip(before, after):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zero_length_q(causal, device):
    q, k, v = _draw(0, SK, device)
    out, lse = _forward(q, k, v, causal, 0, 0)
    assert out.shape == (B, 0, H, D) and lse.shape == (B, H, 0) and lse.dtype == torch.float32
    out_acc, lse_acc = _forward(q, k, v, causal, 0, 0, _state(0, device))
    assert out_acc.shape == (B, 0, H, D) and lse_acc.shape == (B, H, 0)
    before, after = _backward(q, k, v, causal, 0, 0)
    for b_, a in zip(before, after):
        assert torch.equal(a, b_)


# ---------------------------------------------------------------------------------------------------
# causal=True on a block every query sees entirely: the non-causal result, bit for bit

FULL_OFFSETS = [
    pytest.param((SK - 1, 0), id="first-row-sees-last-key"),
    pytest.param((100, 3), id="far-after"),
    pytest.param((2**40, -(2**40)), id="beyond-int32"),
]


@pytest.mark.parametrize("offsets", FULL_OFFSETS)
def test_causal_flag_on_full_block(offsets, device):
    q, k, v = _draw(SQ, SK, device, seed=3)
    qs, ks = offsets
    out, lse = _forward(q, k, v, True, qs, ks)
    out_nc, lse_nc = _forward(q, k, v, False, qs, ks)
    assert torch.equal(out, out_nc) and torch.equal(lse, lse_nc)
    ref_o, ref_l = reference_attention(q.double(), k.double(), v.double(), causal=True, q_start=qs, k_start=ks)
    assert_judged("out", out, ref_o, None, torch.float32)
    assert_judged("lse", lse, ref_l, None, torch.float32, is_lse=True)
    state = _state(SQ, device)
    acc = _forward(q, k, v, True, qs, ks, state)
    acc_nc = _forward(q, k, v, False, qs, ks, state)
    assert torch.equal(acc[0], acc_nc[0]) and torch.equal(acc[1], acc_nc[1])
    _, grads = _backward(q, k, v, True, qs, ks)
    _, grads_nc = _backward(q, k, v, False, qs, ks)
    for name, a, b_ in zip(("dq", "dk", "dv"), grads, grads_nc):
        assert torch.equal(a, b_), name


# ---------------------------------------------------------------------------------------------------
# a causal block no query sees (callers must not pass it): rows (0, -inf), accumulators kept

EMPTY_OFFSETS = [
    pytest.param((0, SQ), id="last-row-before-first-key"),
    pytest.param((-5, 10**12), id="far-before"),
    pytest.param((-(2**40), 2**40), id="beyond-int32"),
]


@pytest.mark.parametrize("offsets", EMPTY_OFFSETS)
def test_causal_block_nothing_visible(offsets, device):
    q, k, v = _draw(SQ, SK, device, seed=4)
    qs, ks = offsets
    out, lse = _forward(q, k, v, True, qs, ks)
    ref_o, ref_l = reference_attention(q.double(), k.double(), v.double(), causal=True, q_start=qs, k_start=ks)
    assert torch.isneginf(ref_l).all()
    assert (out == 0).all() and torch.isneginf(lse).all()
    # merged into a running state: rows that had seen something keep their state up to a rounding (the
    # kernel merges in base 2 and divides by the weight 1 with the GPU's approximate division); rows that
    # had not come out as the canonical (0, -inf)
    state = _state(SQ, device)
    out_acc, lse_acc = _forward(q, k, v, True, qs, ks, state)
    seen = torch.isfinite(state[1])
    rows = seen.transpose(1, 2)
    torch.testing.assert_close(out_acc[rows], state[0][rows], rtol=4 * EPS32, atol=0)
    torch.testing.assert_close(lse_acc[seen], state[1][seen], rtol=4 * EPS32, atol=0)
    assert torch.isneginf(lse_acc[~seen]).all() and (out_acc[~rows] == 0).all()
    before, after = _backward(q, k, v, True, qs, ks)
    for name, b_, a in zip(("dq", "dk", "dv"), before, after):
        assert torch.equal(a, b_), name


# ---------------------------------------------------------------------------------------------------
# fresh accumulators: written, never read; bit for bit the plain forward's state


def _poisoned(sq, device):
    return (torch.full((B, sq, H, D), float("nan"), device=device),
            torch.full((B, H, sq), float("nan"), device=device))


FRESH_CASES = [
    pytest.param((SQ, SK, False, 0, 0), id="full"),
    pytest.param((SQ, SK, True, 20, 3), id="causal-some-rows-empty"),
    pytest.param((SQ, SK, True, 0, SQ), id="causal-nothing-visible"),
    pytest.param((SQ, 0, True, 0, 0), id="zero-length-k"),
    pytest.param((0, SK, False, 0, 0), id="zero-length-q"),
]


@pytest.mark.parametrize("case", FRESH_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fresh_accumulators_are_written_not_read(case, dtype, device):
    sq, sk, causal, qs, ks = case
    q, k, v = _draw(sq, sk, device, seed=5, dtype=dtype)
    kw = dict(softmax_scale=D**-0.5, causal=causal, q_start=qs, k_start=ks)
    out, lse = attention_forward(q, k, v, **kw)
    out_acc, lse_acc = _poisoned(sq, device)
    got = attention_forward(q, k, v, out_acc=out_acc, lse_acc=lse_acc, fresh=True, **kw)
    assert got[0] is out_acc and got[1] is lse_acc
    # the same kernel and arithmetic as the plain forward, stored in float32 instead of q's dtype
    assert torch.equal(out_acc.to(dtype), out) and torch.equal(lse_acc, lse)
    empty = torch.isneginf(lse)
    assert (out_acc[empty.transpose(1, 2)] == 0).all()


def test_fresh_accumulators_under_intervals(device):
    """Rows whose interval is empty get `(0, -inf)` in place of the poison; the others the plain state."""
    q, k, v = _draw(SQ, SK, device, seed=6)
    lo = torch.arange(SQ, dtype=torch.int32, device=device) // 2
    hi = torch.where(torch.arange(SQ, device=device) % 5 == 0, lo, lo + 7).to(torch.int32)
    kw = dict(softmax_scale=D**-0.5, causal=False, q_start=0, k_start=0, key_lo=lo, key_hi=hi)
    out, lse = attention_forward(q, k, v, **kw)
    out_acc, lse_acc = _poisoned(SQ, device)
    attention_forward(q, k, v, out_acc=out_acc, lse_acc=lse_acc, fresh=True, **kw)
    assert torch.equal(out_acc, out) and torch.equal(lse_acc, lse)
    assert torch.isneginf(lse_acc[:, :, ::5]).all() and (out_acc[:, ::5] == 0).all()


# ---------------------------------------------------------------------------------------------------
# the layering: no imports from the package above, one reader of TRITON_INTERPRET


def test_kernels_import_nothing_of_ringlse_above():
    """`ringlse.kernels` imports `ringlse.kernels.*` only (and the package `ringlse` that holds it)."""
    import ast
    from pathlib import Path

    import ringlse.kernels

    for path in sorted(Path(ringlse.kernels.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name == "ringlse" or name.startswith("ringlse."):
                    assert name.startswith("ringlse.kernels"), f"{path.name} imports {name}"


def test_host_needs_no_triton():
    """`ringlse.kernels` and `ringlse.kernels.host` import without Triton; `interpreting()` takes the
    spellings of true that Triton's switch takes."""
    code = (
        "import sys, os\n"
        "sys.modules['triton'] = None\n"  # any import of triton now raises ImportError
        "import ringlse.kernels.host as h\n"
        "assert 'triton' not in [m for m, v in sys.modules.items() if v is not None]\n"
        "for v, want in [('1', True), ('true', True), ('ON', True), ('yes', True), ('y', True),\n"
        "                ('0', False), ('', False), ('false', False), ('2', False), (' 1', False)]:\n"
        "    os.environ['TRITON_INTERPRET'] = v\n"
        "    assert h.interpreting() is want, v\n"
        "del os.environ['TRITON_INTERPRET']\n"
        "assert h.interpreting() is False\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
