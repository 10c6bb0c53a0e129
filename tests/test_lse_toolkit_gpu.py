"""The LSE toolkit on CUDA (`@pytest.mark.gpu`): the public functions in bf16/fp16/fp32, rows up to 1M
columns, the cooperative and aligned kernels, the launch fast path, and log_bmm. Judged as
tests/test_lse_toolkit.py says."""

from __future__ import annotations

import threading

import pytest
import torch

from ringlse import lse as lt
from ringlse.testing import assert_judged
from lse_checks import (
    F64, INTERPRETER_WARNINGS, MODES, call_public, judge_against, kernel_forward, log_bmm_ref, make_ab, make_x,
    softmax_math,
)

pytestmark = INTERPRETER_WARNINGS

# ----------------------------------------------------------------------------------------------------
# GPU: the public functions on CUDA

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
GPU_CASES = [  # rows, cols, dtypes: every size in bf16, a spread in fp32 and fp16 (compile time counts)
    (64, 1, (BF16,)),
    (33, 97, (BF16, FP16, FP32)),
    (2000, 300, (FP32,)),  # many short rows: several rows per program in a small tile
    (16, 4097, (BF16, FP32)),
    # rows off 16-byte boundaries: in 16-byte vectors, one row per program (`fwd_rows_aligned_kernel`),
    # the backward's cooperative pieces
    (257, 1025, (BF16,)),
    (100, 4097, (BF16, FP16, FP32)),
    (8, 16384, (BF16,)),
    (300, 20000, (BF16, FP32)),  # long rows, one program per row (two passes)
    (3, 131072, (BF16, FP16)),  # long rows split over programs
    (2, 1 << 20, (BF16, FP32)),
]


def gpu_params():
    for rows, cols, dtypes in GPU_CASES:
        for dt in dtypes:
            name = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}[dt]
            yield pytest.param(rows, cols, dt, id=f"{rows}x{cols}-{name}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,cols,dtype", list(gpu_params()))
def test_gpu_public(rows, cols, dtype, mode):
    x = make_x((rows, cols), -1, dtype, scale=3.0, seed=13, device="cuda").requires_grad_()
    y = call_public(mode, x, -1)
    assert y.dtype == dtype and not torch.isnan(y).any()
    judge_against("fwd", y.float() if mode == "logsumexp" else y, x.detach(), -1, mode, dtype)
    g = torch.randn(y.shape, device="cuda", dtype=F64).to(dtype)
    (dx,) = torch.autograd.grad(y, x, g)
    assert not torch.isnan(dx).any()
    judge_against("dx", dx, x.detach(), -1, mode, dtype, g=g)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_other_dim_no_copy(mode):
    x = make_x((6, 3000, 40), 1, torch.bfloat16, seed=14, device="cuda").requires_grad_()
    y = call_public(mode, x, 1)
    if mode != "logsumexp":
        assert y.stride() == x.stride()  # the output keeps x's layout: dim 1 was read through strides
    judge_against("fwd", y.float() if mode == "logsumexp" else y, x.detach(), 1, mode, torch.bfloat16)
    g = torch.randn(y.shape, device="cuda").to(torch.bfloat16)
    (dx,) = torch.autograd.grad(y, x, g)
    judge_against("dx", dx, x.detach(), 1, mode, torch.bfloat16, g=g)


COOP_CASES = [  # rows, cols, dim, dtype: pieces of a row in registers, merged across programs
    pytest.param(3, 100003, -1, torch.float32, id="3x100003-fp32"),
    pytest.param(257, 40000, -1, torch.bfloat16, id="257x40000-bf16"),  # read as pairs (PACK)
    pytest.param(129, 40000, -1, torch.float16, id="129x40000-fp16"),
    # odd lengths: rows start anywhere, in 16-byte vectors and words of two (the aligned kernel)
    pytest.param(65, 40001, -1, torch.bfloat16, id="65x40001-bf16"),
    pytest.param(100, 50257, -1, torch.float16, id="100x50257-fp16"),
    pytest.param(70, 40003, -1, torch.float32, id="70x40003-fp32"),
    pytest.param(5, 40001, 0, torch.float32, id="5x40001-dim0-fp32"),  # strided columns
]


@pytest.mark.gpu
@pytest.mark.parametrize("piece,warps", [(1024, 2), (2048, 4), (4096, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("mode", ["softmax", "log_softmax"])
@pytest.mark.parametrize("rows,cols,dim,dtype", COOP_CASES)
def test_gpu_cooperative_long_rows(launches, rows, cols, dim, dtype, mode, piece, warps):
    from ringlse.lse.kernels import softmax as ks

    knobs = {"max_row_block": 16, "max_row_block_16": 16, "max_row_block_bwd": 16, "coop_max_pieces": 1 << 20,
             "coop_min_rows": 1}
    for which in ("fwd", "bwd"):
        knobs.update({f"coop_piece_{which}": piece, f"coop_warps_{which}": warps,
                      f"coop_piece_{which}_16": piece, f"coop_warps_{which}_16": warps})
    shape = (rows, cols) if dim == -1 else (cols, rows)
    x = make_x(shape, dim, dtype, scale=3.0, seed=16, device="cuda")  # with all -inf rows
    g = torch.randn(x.shape, device="cuda", dtype=F64).to(dtype)
    with ks.config_override(**knobs):
        y = ks.softmax_forward(x, dim, log=mode == "log_softmax")
        # the cooperative kernel ran (the grid fits the GPU), alone
        assert [ln.kernel[:9] for ln in launches] == ["fwd_coop_"]
        assert not torch.isnan(y).any()
        judge_against("fwd", y, x, dim, mode, dtype)
        dx = ks.softmax_backward(y, g, dim, log=mode == "log_softmax")
    assert [ln.kernel[:9] for ln in launches] == ["fwd_coop_", "bwd_coop_"]
    assert not torch.isnan(dx).any()
    judge_against("dx", dx, x, dim, mode, dtype, g=g)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [3.0, 30.0], ids=["x3", "x30"])
@pytest.mark.parametrize("rows,cols,kernel", [
    pytest.param(64, 65536, "fwd_coop_kernel", id="64x65536-pairs"),
    pytest.param(65, 50257, "fwd_coop_aligned_kernel", id="65x50257-aligned"),
])
def test_gpu_bf16_softmax_rounded_once(launches, rows, cols, kernel, scale):
    """The bf16 cooperative softmax rounds each output once, from float32: besides the absolute bound
    every output is judged by, each output of at least 2^-29 of its row's largest keeps its relative
    error within the bf16 rounding (2^-8) and the float32 arithmetic's (2^-12, with room)."""
    from ringlse.lse.kernels import softmax as ks

    x = make_x((rows, cols), -1, torch.bfloat16, scale=scale, seed=24, device="cuda")
    ref = softmax_math(x.double(), -1, "softmax")
    tiny = ref.amax(-1, keepdim=True) * 2.0**-29
    judged = (ref > 2.0**-100) & (ref >= tiny)
    y = ks.softmax_forward(x)
    judge_against("fwd", y, x, -1, "softmax", torch.bfloat16)
    rel = ((y.double() - ref).abs() / ref)[judged]
    assert rel.max().item() <= 2.0**-8 + 2.0**-12, rel.max().item()
    assert [ln.kernel for ln in launches] == [kernel]


STRADDLE_CASES = [  # rows, cols, dim, dtype, the modes that take the cooperative forward there
    pytest.param(37, 32768, -1, torch.bfloat16, MODES[:2], id="37x32768-bf16"),  # pairs, no column mask (EVEN)
    pytest.param(37, 40000, -1, torch.bfloat16, MODES[:2], id="37x40000-bf16"),  # pairs, masked last piece
    pytest.param(29, 40001, -1, torch.bfloat16, MODES, id="29x40001-bf16"),  # aligned, words of two
    pytest.param(23, 40003, -1, torch.float32, MODES[:2], id="23x40003-fp32"),  # aligned
    pytest.param(9, 40001, 0, torch.float32, MODES[:2], id="9x40001-dim0-fp32"),  # strided columns
]


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [3, -1], ids=["K+3", "2K-1"])
@pytest.mark.parametrize("rows,cols,dim,dtype,modes", STRADDLE_CASES)
def test_gpu_cooperative_tasks_straddle_steps(launches, rows, cols, dim, dtype, modes, extra):
    """The cooperative forward with a grid that is no whole number of rows (K + 3 or 2K - 1 programs
    for K pieces a row, `coop_max_programs`): rows straddle two steps and a program's piece changes from
    task to task (`next_task`). Right (all -inf rows included), and bit for bit the default grid's
    output."""
    from ringlse.lse.kernels import softmax as ks

    knobs = {"max_row_block": 16, "max_row_block_16": 16, "coop_max_pieces": 1 << 20, "coop_min_rows": 1,
             "coop_piece_fwd": 2048, "coop_warps_fwd": 2,
             "coop_piece_fwd_16": 2048, "coop_warps_fwd_16": 1, "coop_min_pieces_fwd_16": 0,
             "coop_min_slots": 1}  # (one row in flight is enough: no "_long" plan is tried)
    shape = (rows, cols) if dim == -1 else (cols, rows)
    x = make_x(shape, dim, dtype, scale=3.0, seed=24, device="cuda")
    # K: the columns a row's pieces hold (a row off the 16-byte boundaries: its whole vectors) over
    # pieces of 2048 columns
    held = cols
    if dim == -1 and cols * x.element_size() % 16:
        vec = 16 // x.element_size()
        held = cols // vec * vec
    K = -(-held // 2048)
    programs = K + extra if extra > 0 else 2 * K + extra
    assert K > 2 and rows * K > 4 * (K + 3), K  # many steps, each of a part row
    with ks.config_override(**knobs):
        want = [kernel_forward(ks, mode, x, dim) for mode in modes]
        whole = [ln for ln in launches if ln.kernel.startswith("fwd_coop_")]
        assert len(whole) == len(modes) and all(ln.grid[0] >= 2 * K for ln in whole)  # the GPU holds 2 rows
    launches.clear()
    with ks.config_override(**knobs, coop_max_programs=programs):
        for mode, w in zip(modes, want):
            got = kernel_forward(ks, mode, x, dim)
            last = launches[-1]
            assert last.kernel.startswith("fwd_coop_") and last.consts["TASKS"] and last.grid == (programs,)
            assert last.consts["KB"] == 1 << (K - 1).bit_length()
            judge_against("lse" if mode == "logsumexp" else "fwd", got, x, dim, mode, dtype)
            assert torch.equal(got, w)
    assert len(launches) == len(modes)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["softmax", "log_softmax"])
@pytest.mark.parametrize("rows,cols,dtype", [
    pytest.param(257, 40001, torch.bfloat16, id="257x40001-bf16"),
    pytest.param(130, 50257, torch.float16, id="130x50257-fp16"),
    pytest.param(97, 65537, torch.float32, id="97x65537-fp32"),
])
def test_gpu_aligned_forward_l2_ahead(launches, rows, cols, dtype, mode):
    """The aligned cooperative forward asks L2 for the row after the one it loads (sm_90 on): right
    (all -inf rows included)."""
    from ringlse.lse.kernels import softmax as ks

    x = make_x((rows, cols), -1, dtype, scale=3.0, seed=20, device="cuda")
    with ks.config_override(coop_min_rows=1, coop_max_pieces=1 << 20):
        y = kernel_forward(ks, mode, x, -1)
    assert [ln.kernel for ln in launches] == ["fwd_coop_aligned_kernel"]
    assert launches[0].consts["L2_AHEAD"] == (torch.cuda.get_device_capability() >= (9, 0))
    judge_against("fwd", y, x, -1, mode, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("piece,warps", [(512, 1), (2048, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("rows,cols,dtype", [
    pytest.param(300, 4097, torch.bfloat16, id="300x4097-bf16"),
    pytest.param(65, 40001, torch.bfloat16, id="65x40001-bf16"),
    pytest.param(100, 50257, torch.float16, id="100x50257-fp16"),
])
def test_gpu_logsumexp_aligned_pieces(launches, rows, cols, dtype, piece, warps):
    """2-byte logsumexp of rows off the boundaries in the aligned forward (MODE 2), rows cut into
    several pieces whose words piece 0 merges while the others go on; all -inf rows included."""
    from ringlse.lse.kernels import softmax as ks

    knobs = {"max_row_block": 16, "max_row_block_16": 16, "coop_min_rows": 1, "coop_max_pieces": 1 << 20,
             "coop_piece_fwd_16": piece, "coop_warps_fwd_16": warps, "coop_min_pieces_fwd_16": 0, "coop_min_fill": 0.0}
    x = make_x((rows, cols), -1, dtype, scale=3.0, seed=18, device="cuda")
    with ks.config_override(**knobs):
        lse = kernel_forward(ks, "logsumexp", x, -1)
    assert [ln.kernel for ln in launches] == ["fwd_coop_aligned_kernel"]
    judge_against("lse", lse, x, -1, "logsumexp", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,cols,dtype", [
    pytest.param(1000, 513, torch.bfloat16, id="1000x513-bf16"),
    pytest.param(300, 4097, torch.float16, id="300x4097-fp16"),
    pytest.param(64, 16383, torch.bfloat16, id="64x16383-bf16"),  # the widest 2-byte block
    pytest.param(33, 32767, torch.float32, id="33x32767-fp32"),  # the widest block
])
def test_gpu_aligned_rows(launches, rows, cols, dtype, mode):
    """Short rows off 16-byte boundaries compiled, one per program in 16-byte vectors
    (`fwd_rows_aligned_kernel`): every width of block the launcher picks up to the row kernels'
    limits, all -inf rows included."""
    from ringlse.lse.kernels import softmax as ks

    x = make_x((rows, cols), -1, dtype, scale=3.0, seed=19, device="cuda")
    judge_against("fwd", kernel_forward(ks, mode, x, -1), x, -1, mode, dtype)
    assert [ln.kernel for ln in launches] == ["fwd_rows_aligned_kernel"]


@pytest.mark.gpu
def test_gpu_occupancy_rules_match_driver():
    """The occupancy rules give the driver's count for the cooperative kernels as compiled (several
    warps and register caps), so the fallback, where the driver cannot be asked, sizes grids the same."""
    from ringlse.lse.kernels.occupancy import blocks_per_sm_by_driver, blocks_per_sm_by_rules
    from ringlse.lse.kernels.softmax.coop_kernels import fwd_coop_kernel

    x = torch.zeros(64, 8192, device="cuda", dtype=torch.bfloat16)
    words = torch.full((64, 4), -1, dtype=torch.int64, device="cuda")
    props = torch.cuda.get_device_properties(0)
    seen = set()
    for piece, warps, nreg, pack in [(2048, 1, None, 1), (2048, 1, 168, 1), (1024, 2, None, 0), (4096, 4, 128, 0),
                                     (8192, 8, None, 0), (2048, 2, 96, 2)]:
        consts = dict(MODE=0, PIECE=piece // (2 if pack else 1), KB=4, COL64=False, PACK=pack, ASM=True, EVEN=True, TASKS=True)
        if nreg:
            consts["maxnreg"] = nreg
        args = (x, x, words, words, 3, 64, 4096 if pack else 8192, 1, 8192, 0, 1, 8192, 0, 1, 4)
        compiled = fwd_coop_kernel.warmup(*args, grid=(1,), num_warps=warps, **consts)
        compiled._init_handles()
        driver = blocks_per_sm_by_driver(compiled.function, warps, compiled.metadata.shared)
        assert driver is not None
        rules = blocks_per_sm_by_rules(compiled.n_regs, warps, compiled.metadata.shared,
                                       regs_per_sm=props.regs_per_multiprocessor,
                                       threads_per_sm=props.max_threads_per_multi_processor,
                                       smem_per_sm=props.shared_memory_per_multiprocessor)
        assert rules == driver, (piece, warps, nreg, compiled.n_regs)
        seen.add(compiled.n_regs)
    assert len(seen) >= 4  # distinct register counts were compared


@pytest.mark.gpu
def test_gpu_cooperative_long_tier_for_rows_that_fit_once(launches):
    """Rows of a million float32 columns: the first plan's pieces fit fewer than two rows in flight (seen
    with the "_long" plan off), so the launcher takes the "_long" plan (4096-column pieces capped at 128
    registers: two rows in flight)."""
    from ringlse.lse.kernels import softmax as ks

    x = make_x((8, 1 << 20), -1, torch.float32, scale=3.0, seed=19, device="cuda")
    rows_in_flight = lambda ln: ln.grid[0] // -(-(1 << 20) // ln.consts["PIECE"])  # noqa: E731
    with ks.config_override(coop_min_rows=1, coop_piece_fwd_long=None):  # (no "_long" plan: the first alone)
        ks.softmax_forward(x, -1)
    first = launches[-1]
    # fewer than two rows in flight (none: the cooperative kernel did not fit, the two-pass kernels ran)
    assert first.kernel != "fwd_coop_kernel" or (first.consts["PIECE"] < 4096 and rows_in_flight(first) < 2), first
    with ks.config_override(coop_min_rows=1):
        y = ks.softmax_forward(x, -1)
    last = launches[-1]
    assert last.consts["PIECE"] == 4096 and last.consts["maxnreg"] == 128 and rows_in_flight(last) >= 2, last
    judge_against("fwd", y, x, -1, "softmax", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_cooperative_longer_pieces_for_long_rows(launches, dtype):
    """A row of more than `coop_max_pieces` pieces takes longer pieces (here 1024 columns x 40 pieces
    -> 8192 x 5 on 8 warps), through the default launch path."""
    from ringlse.lse.kernels import softmax as ks

    knobs = {"max_row_block": 16, "max_row_block_16": 16, "max_row_block_bwd": 16, "coop_max_pieces": 8, "coop_min_rows": 1}
    for which, half in (("fwd", ""), ("fwd", "_16"), ("bwd", ""), ("bwd", "_16")):
        knobs.update({f"coop_piece_{which}{half}": 1024, f"coop_warps_{which}{half}": 2})
    x = make_x((70, 40001), -1, dtype, scale=3.0, seed=18, device="cuda")
    with ks.config_override(**knobs):
        for mode in ("softmax", "log_softmax"):
            y = ks.softmax_forward(x, -1, log=mode == "log_softmax")
            judge_against("fwd", y, x, -1, mode, dtype)
            g = torch.randn(x.shape, device="cuda", dtype=F64).to(dtype)
            judge_against("dx", ks.softmax_backward(y, g, -1, log=mode == "log_softmax"), x, -1, mode, dtype, g=g)
    assert [ln.kernel[:9] for ln in launches] == ["fwd_coop_", "bwd_coop_"] * 2
    # (rows of 40001 columns, off the boundaries: 10000 whole 16-byte vectors, 40000 float32 units or
    # 20000 bf16 words, in 5 pieces of 8192 columns)
    fwd = launches[0]
    assert fwd.num_warps == 8 and fwd.consts["PIECE"] == (8192 if dtype == torch.float32 else 4096), fwd
    assert fwd.consts["KB"] == 8  # (5 pieces)


@pytest.mark.gpu
def test_gpu_cooperative_kernels_on_two_streams_at_once():
    """Two cooperative grids that each fill the GPU, queued on two streams at once, both finish and
    match the results of one stream: they launch as cooperative grids, so the driver never leaves part
    of one grid waiting behind the other while its placed programs spin."""
    from ringlse.lse.kernels import softmax as ks
    from ringlse.kernels.launch import recorded_launches

    x1 = torch.randn(256, 65536, device="cuda")
    x2 = torch.randn(128, 131072, device="cuda", dtype=torch.bfloat16)
    with recorded_launches() as launches:
        want = [ks.softmax_forward(x1), ks.softmax_forward(x2, log=True)]
    assert all(ln.kernel.startswith("fwd_coop_") and ln.consts["launch_cooperative_grid"] for ln in launches)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    got = [], []
    torch.cuda.synchronize()
    for _ in range(20):
        with torch.cuda.stream(s1):
            got[0].append(ks.softmax_forward(x1))
        with torch.cuda.stream(s2):
            got[1].append(ks.softmax_forward(x2, log=True))
    torch.cuda.synchronize()
    for w, gs in zip(want, got):
        for g in gs:
            assert torch.equal(g, w)


@pytest.mark.gpu
def test_gpu_cooperative_words_taken_by_turns():
    """The cooperative launches of one stream take their words from two buffers by turns, each launch
    resetting what the one before left (`_coop_words`): calls of other shapes, the backward, a larger
    call that replaces the buffers, and graph capture (fresh words) in between give the same results
    as the first calls."""
    from ringlse.lse.kernels import softmax as ks

    xs = [make_x(shape, -1, dtype, scale=3.0, seed=20, device="cuda")
          for shape, dtype in (((256, 65536), torch.float32), ((300, 40000), torch.bfloat16),
                               ((512, 131072), torch.float32))]
    g = torch.randn_like(xs[0])
    y0 = ks.softmax_forward(xs[0])  # (0 on the all -inf rows, where torch.softmax gives NaN)
    calls = [lambda: ks.softmax_forward(xs[0]), lambda: ks.softmax_forward(xs[1], log=True),
             lambda: ks.softmax_backward(y0, g), lambda: ks.softmax_forward(xs[2])]
    first = [c() for c in calls]
    judge_against("fwd", first[0], xs[0], -1, "softmax", torch.float32)
    judge_against("fwd", first[1], xs[1], -1, "log_softmax", torch.bfloat16)
    judge_against("dx", first[2], xs[0], -1, "softmax", torch.float32, g=g)
    for order in ([3, 0, 2, 1], [1, 1, 0, 0], [2, 3, 1, 0]):
        for i in order:
            assert torch.equal(calls[i](), first[i]), i
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ks.softmax_forward(xs[1], log=True)  # (plan and compile off the capture)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = ks.softmax_forward(xs[1], log=True)
    for _ in range(3):
        graph.replay()
        assert torch.equal(calls[0](), first[0])
        torch.cuda.synchronize()
        assert torch.equal(captured, first[1])


@pytest.mark.gpu
def test_gpu_logsumexp_split_reuses_counters():
    """The split logsumexp's last piece merges and zeroes its row counter (kept between calls): repeated
    calls of growing and shrinking row counts, into NaN-poisoned outputs, each write every lse, right."""
    from ringlse.lse.kernels import softmax as ks

    for rows in (3, 3, 40, 3, 40):
        x = make_x((rows, 70001), -1, torch.float32, scale=3.0, seed=19 + rows, device="cuda")
        lse = kernel_forward(ks, "logsumexp", x, -1)
        assert not lse.isnan().any()
        judge_against("fwd", lse, x, -1, "logsumexp", torch.float32)


@pytest.mark.gpu
def test_gpu_scratch_per_stream():
    """Calls queued on two streams at once keep their scratch apart (partials, counters and words are
    kept per stream and thread): the split forward and logsumexp (per-piece partials, row counters) and
    the cooperative forward of equal shapes, alternated on two streams, give bit for bit the results of
    one stream."""
    from ringlse.lse.kernels import softmax as ks

    cases = [(lambda x: ks.softmax_forward(x), (8, 131072)), (lambda x: ks.logsumexp_forward(x), (8, 131072)),
             (lambda x: ks.softmax_forward(x, log=True), (256, 65536))]
    inputs = [[make_x(shape, -1, torch.float32, scale=3.0, seed=60 + 2 * c + t, device="cuda") for t in range(2)]
              for c, (_, shape) in enumerate(cases)]
    want = [[fn(x) for x in xs] for (fn, _), xs in zip(cases, inputs)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    got = []
    for _ in range(20):
        for t, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                got.append([(c, t, fn(xs[t])) for c, ((fn, _), xs) in enumerate(zip(cases, inputs))])
    torch.cuda.synchronize()
    bad = [(c, t) for step in got for c, t, y in step if not torch.equal(y, want[c][t])]
    assert not bad, bad[:10]


@pytest.mark.gpu
def test_gpu_threads_sharing_a_stream():
    """Threads calling the launchers on one (the default) stream interleave their launches: the split
    forward (a stats kernel, then a normalising kernel that reads its partials), the split logsumexp
    (row counters) and the cooperative forward (words taken by turns) still give each call its own
    result, bit for bit the single-threaded one."""
    from ringlse.lse.kernels import softmax as ks

    cases = [(lambda x: ks.softmax_forward(x), (8, 131072)), (lambda x: ks.logsumexp_forward(x), (8, 131072)),
             (lambda x: ks.softmax_forward(x, log=True), (256, 65536))]
    inputs = [[make_x(shape, -1, torch.float32, scale=3.0, seed=40 + 3 * c + t, device="cuda") for t in range(3)]
              for c, (_, shape) in enumerate(cases)]
    want = [[fn(x) for x in xs] for (fn, _), xs in zip(cases, inputs)]
    torch.cuda.synchronize()
    bad = []

    def worker(t: int) -> None:
        for _ in range(40):
            got = [fn(xs[t]) for (fn, _), xs in zip(cases, inputs)]
            torch.cuda.synchronize()
            bad.extend((t, c) for c, g in enumerate(got) if not torch.equal(g, want[c][t]))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not bad, bad[:10]


def _placed(x: torch.Tensor, where: str) -> torch.Tensor:
    """`x` copied to a 16-byte-aligned buffer ("aligned"), one element past one ("offset": same strides,
    so the same integer arguments: only the pointer alignment differs), or a view `[:, 1:]` of a wider
    buffer ("sliced": misaligned, rows one element longer apart)."""
    rows, cols = x.shape
    if where == "sliced":
        out = torch.empty(rows, cols + 1, dtype=x.dtype, device=x.device)[:, 1:]
    else:
        off = 0 if where == "aligned" else 1
        out = torch.empty(x.numel() + 16, dtype=x.dtype, device=x.device)[off:off + x.numel()].view(x.shape)
    assert (out.data_ptr() % 16 == 0) == (where == "aligned")
    return out.copy_(x)


def _placed_vector(v: torch.Tensor, where: str) -> torch.Tensor:
    """A vector `v` copied to a 16-byte-aligned buffer ("aligned") or one element past one (else)."""
    off = 0 if where == "aligned" else 1
    return torch.empty(v.numel() + 16, dtype=v.dtype, device=v.device)[off:off + v.numel()].copy_(v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("regime", ["rows", "split"])
@pytest.mark.parametrize("order", ["aligned-first", "misaligned-first"])
def test_gpu_fast_launch_alignment_and_int_specialisation(monkeypatch, order, regime, dtype):
    """The plans' `BoundLaunch`es cache compiled kernels under their own keys: a kernel compiled for
    16-byte-aligned pointers (or for R == 1) must never serve a misaligned input (or R == 3),
    whichever runs first; logsumexp's backward takes lse and g of any alignment in one plan.
    Forward, logsumexp and both backwards on the same shapes, against float64."""
    from ringlse.kernels import launch as kl
    from ringlse.lse.kernels import softmax as ks

    slow, real = [], kl.launch
    monkeypatch.setattr(kl, "launch", lambda kernel, *a, **k: slow.append(kernel.fn.__name__) or real(kernel, *a, **k))
    # ("split": long rows through the two-kernel paths; 1 and 3 rows are too few for the cooperative ones)
    cols = (97, 4097) if regime == "rows" else (40001,)
    wheres = ["aligned", "offset", "sliced"]
    row_counts = [1, 3]
    if order == "misaligned-first":
        wheres.reverse()
        row_counts.reverse()
    for rows in row_counts:
        for n in cols:
            x0 = make_x((rows, n), -1, dtype, scale=3.0, seed=22 + rows, device="cuda")
            g0 = torch.randn(rows, n, device="cuda", dtype=F64).to(dtype)
            gl0 = torch.randn(rows, device="cuda", dtype=F64).to(dtype)
            for where in wheres:
                x = _placed(x0, where)
                for log in (False, True):
                    mode = "log_softmax" if log else "softmax"
                    y = ks.softmax_forward(x, log=log)
                    judge_against(f"fwd {where}", y, x0, -1, mode, dtype)
                    dx = ks.softmax_backward(_placed(y, where), _placed(g0, where), log=log)
                    judge_against(f"dx {where}", dx, x0, -1, mode, dtype, g=g0)
                lse = ks.logsumexp_forward(x)
                judge_against(f"lse {where}", lse, x0, -1, "logsumexp", dtype)
                dx = ks.logsumexp_backward(x, _placed_vector(lse, where), _placed_vector(gl0, where))
                judge_against(f"lse dx {where}", dx, x0, -1, "logsumexp", dtype, g=gl0)
    torch.cuda.synchronize()
    # the fast path ran (Triton 3.6): no launch went to Triton's own
    assert not slow, slow


@pytest.mark.gpu
def test_gpu_tritons_own_launch_path(monkeypatch):
    """With the fast paths off (`launch.FAST_PATH`: a Triton other than 3.6), every launch is Triton's own
    `kernel[grid](...)`, cooperative grids included: bit for bit the fast paths' results, for the row,
    aligned, split and cooperative kernels, forward and backward."""
    from ringlse.kernels import launch as kl
    from ringlse.lse.kernels import softmax as ks

    cases = [((64, 4097), torch.bfloat16), ((3, 131072), torch.float32), ((256, 65536), torch.float32),
             ((300, 40001), torch.bfloat16), ((100, 50257), torch.float16)]
    inputs = [make_x(shape, -1, dtype, scale=3.0, seed=50, device="cuda") for shape, dtype in cases]
    grads = [torch.randn(x.shape, device="cuda").to(x.dtype) for x in inputs]

    def run():
        out = []
        for x, g in zip(inputs, grads):
            y, ly, lse = ks.softmax_forward(x), ks.softmax_forward(x, log=True), ks.logsumexp_forward(x)
            out += [y, ly, lse, ks.softmax_backward(y, g), ks.softmax_backward(ly, g, log=True),
                    ks.logsumexp_backward(x, lse, g[:, 0])]
        return out

    with kl.recorded_launches() as fast:
        want = run()
    assert kl.FAST_PATH and {"fwd_coop_kernel", "fwd_coop_aligned_kernel", "fwd_stats_kernel",
                             "fwd_rows_aligned_kernel"} <= {ln.kernel for ln in fast}
    slow, real = [], kl.launch
    monkeypatch.setattr(kl, "launch", lambda kernel, *a, **k: slow.append(kernel.fn.__name__) or real(kernel, *a, **k))
    monkeypatch.setattr(kl, "FAST_PATH", False)
    with kl.recorded_launches() as launched:
        got = run()
    torch.cuda.synchronize()
    assert slow == [ln.kernel for ln in launched] == [ln.kernel for ln in fast]  # every launch: Triton's path
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w, g), i


@pytest.mark.gpu
def test_gpu_matches_torch_softmax():
    x = torch.randn(64, 5000, device="cuda")
    torch.testing.assert_close(lt.softmax(x), torch.softmax(x, -1), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lt.logsumexp(x), torch.logsumexp(x, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "dims", [pytest.param((2, 97, 130, 200), id="2x97x130x200"), pytest.param((1, 256, 64, 256), id="1x256x64x256")]
)
@pytest.mark.parametrize("factored", [False, True], ids=["exact", "factored"])
def test_gpu_log_bmm(dims, dtype, factored):
    from ringlse.lse.kernels import log_bmm as kl

    a, b = make_ab(*dims, dtype, seed=15, device="cuda")
    a.requires_grad_()
    b.requires_grad_()
    with kl.config_override(dot_min_tiles=1 if factored else 1 << 62):
        out = lt.log_bmm(a, b)
        g = torch.randn(out.shape, device="cuda")
        ga, gb = torch.autograd.grad(out, (a, b), g)
    ref, ra, rb = log_bmm_ref(a.detach(), b.detach(), g)
    assert_judged("out", out, ref, None, torch.float32)
    tol_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    assert_judged("grad_a", ga, ra, ra.to(dtype), tol_dtype)
    assert_judged("grad_b", gb, rb, rb.to(dtype), tol_dtype)

