"""Work run on every spawned rank by the ring tests (importable by spawned processes).

Each function builds the same full random inputs on every rank (same seed), shards them, runs the ring
forward and backward, gathers, and on rank 0 compares with the float64 reference on the full sequence.
"""

from __future__ import annotations

import re

import torch

import ringlse
from ringlse.testing import RESULT_NAMES as NAMES
from ringlse.testing import attention_with_grads, judge_all, random_inputs, ring_with_grads


# what a survivor of a dead or stalled rank raises: the phase, the ring step and the peer it waited for
FAULT_RE = re.compile(r"^ring_attention: (agreement|forward|backward) step (\d+): waiting for (ranks? [\d, ]+) "
                      r"\(global [\d, ]+\): ")
GROWTH_BAR = 1.25  # CONVENTIONS.md §7: the error at W = 4 at most 1.25x the error at W = 1


def growth_failures(many: dict, one: dict, world: int) -> list[str]:
    """What breaks CONVENTIONS.md §7 between rank 0's results of one case at W = `world` and at W = 1: a result
    outside its bound at either size, or an RMS error more than `GROWTH_BAR` times W = 1's (RMS, not
    max: see the module docstring of `ringlse.testing`). Max errors are shown alongside."""
    bad = [f"W={w}: {text}" for w, r in ((world, many), (1, one)) for _, ok, text in r["verdicts"] if not ok]
    for name in NAMES:
        a, b = many["rms_err"][name], one["rms_err"][name]
        # + 1e-6: a float32 lse of ~8 is rounded by up to 5e-7; errors at that level are no growth
        if a > GROWTH_BAR * b + 1e-6:
            bad.append(f"{name}: rms W={world} {a:.3e} vs W=1 {b:.3e} ({a / b:.3f}x); max {many['max_err'][name]:.3e} "
                       f"vs {one['max_err'][name]:.3e}")
    return bad


def rank_device() -> torch.device:
    """This rank's device: its GPU on an NCCL group, else the CPU."""
    nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def check_case(rank, world, case: dict) -> dict | None:
    """Run one case; rank 0 returns {'max_err': {...}, 'rms_err': {...}, 'verdicts': [...]} (float64 cases
    assert_close).

    On an NCCL group the inputs live on this rank's GPU and `case["backend"]` picks the block op."""
    dtype = case["dtype"]
    device = rank_device()
    q, k, v, dout, dlse = random_inputs(case["b"], case["s"], case["h"], case["hkv"], case["d"], dtype, case["seed"], device)
    # the lse gradient is exercised where exactness is checked (float64), unless a case says otherwise;
    # without one the differentiated call returns out alone (bf16 gradient messages for `sdpa`)
    with_dlse = case.get("lse_grad", dtype == torch.float64)
    dlse = dlse if with_dlse else None
    backend = case.get("backend", "torch")
    if backend == "sdpa_cpu":  # the sdpa op's CPU kernels: the parts path of the ring without a GPU
        from ringlse.blocks.sdpa import SDPA_BLOCK_OP as backend
    elif backend == "torch_dq_with_dkdv":  # the ring's path for ops that add dq in their dk/dv pass (Hopper)
        import dataclasses

        from ringlse.blocks.torch_math import TORCH_BLOCK_OP
        backend = dataclasses.replace(TORCH_BLOCK_OP, caps=dataclasses.replace(TORCH_BLOCK_OP.caps,
                                                                            dq_with_dkdv=lambda q, k, v: True))
    ours = ring_with_grads(q, k, v, dout, dlse, causal=case["causal"], layout=case["layout"], backend=backend,
                           non_contiguous=case.get("non_contiguous", False),
                           return_lse=case.get("return_lse", with_dlse))
    if rank != 0:
        return None
    result = {"max_err": {}, "rms_err": {}, "verdicts": []}
    if dtype == torch.float64:
        ref = attention_with_grads(ringlse.reference_attention, q, k, v, dout, dlse, upcast=True,
                                   causal=case["causal"], q_start=0, k_start=0)
        for name, a, b in zip(NAMES, ours, ref):
            torch.testing.assert_close(a, b, msg=lambda m: f"{name} {case}: {m}")
            diff = (a - b).nan_to_num(0.0).abs()
            result["max_err"][name] = diff.max().item()
            result["rms_err"][name] = diff.square().mean().sqrt().item()
        return result
    for vd in judge_all(ours, q, k, v, dout, causal=case["causal"]):
        result["verdicts"].append((vd.name, vd.ok, str(vd)))
        result["max_err"][vd.name] = vd.max_err
        result["rms_err"][vd.name] = vd.rms_err
    return result


def battery(rank, world, cases: list[dict]) -> list:
    return [check_case(rank, world, c) for c in cases]


def expect_value_errors(rank, world, layout_bad_n: int) -> list[tuple[str, bool, str]]:
    """Each bad input must raise ValueError on every rank (and then the group still works)."""
    results = []

    def attempt(name, fn):
        try:
            fn()
        except ValueError as e:
            results.append((name, True, str(e)))
        else:
            results.append((name, False, "no error"))

    # CUDA tensors on an NCCL group (rank r on GPU r), CPU tensors on gloo
    device = f"cuda:{torch.cuda.current_device()}" if torch.distributed.get_backend() == "nccl" else "cpu"

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype, device=device)
    # length that does not divide: zigzag needs an even local length
    attempt("zigzag odd local length", lambda: ringlse.ring_attention(
        r(1, layout_bad_n, 2, 8), r(1, layout_bad_n, 2, 8), r(1, layout_bad_n, 2, 8), causal=True, layout="zigzag"))
    attempt("dtype mismatch", lambda: ringlse.ring_attention(
        r(1, 4, 2, 8), r(1, 4, 2, 8, dtype=torch.float64), r(1, 4, 2, 8)))
    attempt("heads not divisible", lambda: ringlse.ring_attention(r(1, 4, 6, 8), r(1, 4, 4, 8), r(1, 4, 4, 8)))
    attempt("unknown layout", lambda: ringlse.ring_attention(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), layout="spiral"))
    attempt("window below -1", lambda: ringlse.ring_attention(
        r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), window_size=(-3, 0)))
    attempt("documents not ending at S", lambda: ringlse.ring_attention(
        r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), cu_seqlens=[0, 4 * world - 1]))
    attempt("unknown backend", lambda: ringlse.ring_attention(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), backend="nope"))
    # a V head dim of its own is computed by the torch and triton ops; others refuse it by name
    from ringlse.blocks.sdpa import SDPA_BLOCK_OP

    attempt("V head dim differs", lambda: ringlse.ring_attention(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 4),
                                                                 backend=SDPA_BLOCK_OP))
    # only rank 1 (or 0 for W=1) is wrong: the others must not hang in the ring
    bad_rank = min(1, world - 1)
    kd = torch.float16 if rank == bad_rank else torch.float32
    attempt("one rank bad dtype", lambda: ringlse.ring_attention(r(1, 4, 2, 8), r(1, 4, 2, 8).to(kd), r(1, 4, 2, 8).to(kd)))
    if world > 1:
        n = 8 if rank == 0 else 4
        attempt("ranks disagree on length", lambda: ringlse.ring_attention(r(1, n, 2, 8), r(1, n, 2, 8), r(1, n, 2, 8)))
        vd = 4 if rank == 0 else 6
        attempt("ranks disagree on V head dim", lambda: ringlse.ring_attention(
            r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, vd), backend="torch"))
        attempt("ranks disagree on causal", lambda: ringlse.ring_attention(
            r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), causal=rank == 0, layout="contiguous"))
        docs = [0, 2, 4 * world] if rank == 0 else [0, 3, 4 * world]
        attempt("ranks disagree on documents", lambda: ringlse.ring_attention(
            r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), causal=True, layout="stripe", cu_seqlens=docs,
            backend="torch"))
    attempt("shard length not divisible", lambda: ringlse.shard(r(1, 2 * world + 1, 2, 8), "zigzag"))
    # the group is still usable after all that
    x = torch.full((1,), float(rank), device=device)
    torch.distributed.all_reduce(x)
    results.append(("group usable after errors", x.item() == world * (world - 1) / 2, str(x.item())))
    return results


def shard_roundtrip(rank, world) -> bool:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 4 * world, 3, 5, generator=gen)
    for layout in ringlse.ring.LAYOUTS:
        for dim in (1, 2) if layout != "zigzag" else (1,):
            y = x if dim == 1 else x.transpose(1, 2).contiguous()
            local = ringlse.shard(y, layout, dim=dim)
            assert local.shape[dim] == y.shape[dim] // world
            torch.testing.assert_close(ringlse.unshard(local, layout, dim=dim), y, rtol=0, atol=0)
    return True


def subgroup_rings(rank, world) -> bool:
    """Two independent rings over the sub-groups {0, 2} and {1, 3}: point-to-point peers are the
    group's neighbours mapped to global ranks, and each ring is exact (float64)."""
    dist = torch.distributed
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    group = groups[rank % 2]
    q, k, v, dout, dlse = random_inputs(1, 24, 4, 2, 16, torch.float64, seed=40 + rank % 2)
    for causal, layout in ((True, "zigzag"), (False, "stripe")):
        ours = ring_with_grads(q, k, v, dout, dlse, causal=causal, layout=layout, backend="torch", group=group)
        ref = attention_with_grads(ringlse.reference_attention, q, k, v, dout, dlse, upcast=True,
                                   causal=causal, q_start=0, k_start=0)
        for name, a, b in zip(NAMES, ours, ref):
            torch.testing.assert_close(a, b, msg=lambda m: f"rank {rank} {name} {layout}: {m}")
    return True


def nan_inputs_finish(rank, world) -> bool:
    """NaN/inf inputs are the caller's problem, but every rank must still get through the ring."""
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    if rank == 0:
        q[0, 0, 0, 0] = float("nan")
        k[0, 1, 1, 1] = float("inf")
    out = ringlse.ring_attention(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), causal=True)
    out.sum().backward()
    return True


def window_rule_op():
    """The torch op behind the `Masks.WINDOW` contract (as fa4's op): a call's window rule becomes the
    intervals it stands for, so the ring's window-as-a-rule plans run on exact float64 math."""
    import dataclasses

    from ringlse.blocks.contract import Masks
    from ringlse.blocks.torch_math import TORCH_BLOCK_OP
    from ringlse.masks import Rule, Span, planned_intervals

    def as_intervals(q, k, kw):
        window = kw.pop("window_size", None)
        if window is not None:
            kw["intervals"] = planned_intervals(Rule(kw["causal"], tuple(window)), Span(kw["q_start"], q.shape[1]),
                                                Span(kw["k_start"], k.shape[1]))
            kw["causal"] = False
        return kw

    def forward(q, k, v, **kw):
        return TORCH_BLOCK_OP.forward(q, k, v, **as_intervals(q, k, kw))

    def backward(dout, q, k, v, out, lse, delta, **kw):
        return TORCH_BLOCK_OP.backward(dout, q, k, v, out, lse, delta, **as_intervals(q, k, kw))

    return dataclasses.replace(TORCH_BLOCK_OP, name="torch-window-rule", forward=forward, backward=backward,
                               caps=dataclasses.replace(TORCH_BLOCK_OP.caps, masks=Masks.WINDOW))


def masked_rings(rank, world, cases: list[dict]) -> list[str]:
    """Rings with windows and documents (global boundaries crossing ranks) against the dense-mask
    oracle (float64 on the CPU), forward and backward; returns the failures. On an NCCL group the
    inputs live on this rank's GPU; a case's `d` is the head dim (default 8)."""
    from mask_oracle import oracle

    failures = []
    device = rank_device()
    for c in cases:
        s = c["s"]
        dtype = c.get("dtype", torch.float64)
        q, k, v, dout, dlse = random_inputs(1, s, 4, 2, c.get("d", 8), torch.float64, seed=c["seed"])
        low = [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]
        kw = dict(causal=c["causal"], window_size=c["window"], cu_seqlens=c["docs"])
        local = [ringlse.shard(t, c["layout"], cu_seqlens=c["docs"]) for t in low]
        ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
        backend = c.get("backend", "torch")
        if backend == "sdpa_cpu":  # an op without intervals: documents as one plain call per document
            from ringlse.blocks.sdpa import SDPA_BLOCK_OP as backend
        elif backend == "window_rule":  # an op taking windows as a rule only (as fa4's): calls with `window`
            backend = window_rule_op()
        out, lse = ringlse.ring_attention(ql, kl, vl, layout=c["layout"], return_lse=True, backend=backend, **kw)
        loss = (out.double() * local[3].double()).sum() + (
            lse.double().nan_to_num(neginf=0.0) * ringlse.shard(dlse.to(device), c["layout"], dim=2,
                                                                cu_seqlens=c["docs"])).sum()
        loss.backward()
        ours = [ringlse.unshard(t.detach(), c["layout"], dim=d, cu_seqlens=c["docs"]).cpu()
                for t, d in ((out, 1), (lse, 2), (ql.grad, 1), (kl.grad, 1), (vl.grad, 1))]
        low = [t.cpu() for t in low]
        leaves = [t.double().requires_grad_() for t in low[:3]]
        r_out, r_lse = oracle(*leaves, range(s), range(s), c["causal"], c["window"], c["docs"])
        ((r_out * low[3].double()).sum() + (r_lse.nan_to_num(neginf=0.0) * dlse).sum()).backward()
        for name, a, b in zip(NAMES, ours, [r_out, r_lse, *(t.grad for t in leaves)]):
            try:
                if dtype == torch.float64:
                    torch.testing.assert_close(a, b.detach())
                else:  # CONVENTIONS.md §7 for float32
                    ref = b.detach()
                    err = (a.double() - ref).nan_to_num(nan=float("inf"), posinf=0.0, neginf=0.0).abs().max()
                    bound = 1e-3 * ref[torch.isfinite(ref)].abs().max()
                    assert err <= bound, f"max error {float(err):.3e} > {float(bound):.3e}"
            except AssertionError as e:
                failures.append(f"rank {rank} {c}: {name}: {str(e).splitlines()[0]}")
    return failures


# --- faults, load and bad input (tests/test_ring_faults.py) -------------------------------------------------------


def _fault_op(victim: int, rank: int, where: str, call_no: int, action: str, seconds: float):
    """The torch block op, except that on rank `victim` its `where` (forward/backward) call number
    `call_no` exits the process (`action="exit"`) or sleeps `seconds` (`"stall"`) first."""
    import dataclasses
    import os
    import time

    base = ringlse.get_block_op("torch", rank_device())
    calls = [0]

    def fault():
        calls[0] += 1
        if rank == victim and calls[0] == call_no:
            if action == "exit":
                os._exit(0)
            time.sleep(seconds)

    if where == "forward":
        def forward(*args, **kw):
            fault()
            return base.forward(*args, **kw)
        return dataclasses.replace(base, forward=forward)

    def backward(*args, **kw):
        fault()
        return base.backward(*args, **kw)
    return dataclasses.replace(base, backward=backward)


def _outcome(fn, *args, **kw) -> dict:
    """`fn(*args, **kw)`'s end on this rank: returned, or raised (type, message, cause), and when."""
    import time

    t0 = time.monotonic()
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - what the survivor got is the result
        return dict(returned=False, type=type(e).__name__, message=str(e), elapsed=time.monotonic() - t0,
                    cause=type(e.__cause__).__name__ if e.__cause__ is not None else None)
    return dict(returned=True, elapsed=time.monotonic() - t0)


def ring_fault(rank, world, victim: int, where: str, action: str, timeout, seconds: float = 0.0,
               warm: bool = False) -> dict:
    """One ring call (forward and backward, contiguous and non-causal: one block call per step) during
    which rank `victim` exits or stalls `where`: before the agreement, or in its block op's forward or
    backward at step 1 (the second call: the own block is call 1; the backward's own block is split in
    two halves, the first before step 1). Survivors return what they got, then what a second call on
    the same group gets (it must refuse at once: the failed call's messages may still be in flight).
    `warm`: a good ring call first (the fault then hits a group whose rings already ran)."""
    import time

    q, k, v = (torch.randn(1, 8, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank * 3 + i))
               .to(rank_device()).requires_grad_() for i in range(3))
    if warm:
        ringlse.ring_attention(q, k, v, layout="contiguous", backend="torch").sum().backward()
    call_no = 2
    op = _fault_op(victim, rank, where if where != "agreement" else "forward", call_no, action, seconds)
    # every rank has finished joining the group before anyone fails (an exit during the others'
    # connection set-up fails their init instead of the ring call under test)
    torch.distributed.barrier()
    if where == "agreement" and rank == victim:
        if action == "exit":
            import os
            os._exit(0)
        time.sleep(seconds)

    def call():
        out = ringlse.ring_attention(q, k, v, layout="contiguous", backend=op, timeout=timeout)
        out.sum().backward()
        if q.is_cuda:  # a result is only a result once the GPU has computed it (a stuck stream hangs here)
            torch.cuda.synchronize()

    first = _outcome(call)
    first["again"] = _outcome(call) if not first["returned"] else None
    return first


def bad_input_fuzz(rank, world, seed: int) -> dict:
    """Each rank draws its own input from `seed` and its rank: a good one, or one wrong in one way
    (shape, dtype, heads, layout, documents, window, timeout); rank `seed % world` is always wrong.
    Returns what this rank raised and what it drew."""
    import random

    rng = random.Random(seed * 7919 + rank)
    kinds = ("shape", "dtype", "heads", "layout", "docs", "window", "timeout", "value")
    kind = rng.choice(kinds) if rank == seed % world or rng.random() < 0.6 else "good"
    n, h, hkv, d = 4 * rng.randint(1, 3), 4, 2, 8
    s = n * world
    dtype = rng.choice((torch.float32, torch.float64))
    shapes = {"q": [1, n, h, d], "k": [1, n, hkv, d]}
    kw = dict(causal=True, layout="stripe", cu_seqlens=[0, s // 2, s], window_size=(-1, -1), timeout=None)
    if kind == "shape":
        shapes[rng.choice("qk")][rng.choice((0, 1, 3))] += rng.randint(1, 3)  # batch, length or head dim
    elif kind == "heads":
        shapes["q"][2] = rng.choice((3, 5, 7))
    elif kind == "layout":
        kw["layout"] = rng.choice(("spiral", 3))
    elif kind == "docs":
        kw["cu_seqlens"] = rng.choice(([0, s + 1], [1, s], [0, s // 2 + 1, s // 2, s], [0, s - 1]))
    elif kind == "window":
        kw["window_size"] = (rng.choice((-2, -5)), rng.choice((-1, 0, 3)))
    elif kind == "timeout":
        kw["timeout"] = rng.choice((0, -1.5, float("nan"), "soon"))
    elif kind == "value":
        kw["causal"] = rng.choice(("yes", 1))
    q = torch.randn(*shapes["q"], dtype=dtype)
    k = torch.randn(*shapes["k"], dtype=dtype if kind != "dtype" else rng.choice((torch.float16, torch.bfloat16)))
    v = torch.randn(*shapes["k"], dtype=dtype)
    if kind == "dtype":
        v = v.to(k.dtype)  # k and v agree; q does not
    try:
        ringlse.ring_attention(q, k, v, **kw)
    except ValueError as e:
        return dict(kind=kind, type="ValueError", message=str(e))
    except Exception as e:  # noqa: BLE001
        return dict(kind=kind, type=type(e).__name__, message=str(e))
    return dict(kind=kind, type=None, message="")


def disagreeing_ranks(rank, world) -> list[str]:
    """Valid inputs that differ between ranks (length, causal): the messages of every rank."""
    messages = []
    n = 8 if rank == 0 else 4
    for kw in (dict(q=(1, n, 2, 8)), dict(causal=rank == 1, layout="contiguous")):
        shape = kw.pop("q", (1, 4, 2, 8))
        q = torch.randn(*shape)
        try:
            ringlse.ring_attention(q, q, q, **kw)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


def nan_key_rows(rank, world, cases: list[dict]) -> list[str]:
    """A NaN in one key position through the ring (torch backend, float64): the output and lse rows
    that see that key (CONVENTIONS.md §10) are NaN, every other row equals the reference computed
    with that key finite. Returns the failures."""
    from mask_oracle import oracle

    failures = []
    for c in cases:
        s, pos = c["s"], c["pos"]
        q, k, v, _, _ = random_inputs(1, s, 4, 2, 8, torch.float64, seed=c["seed"])
        bad = k.clone()
        bad[0, pos, c.get("head", 0), 3] = float(c.get("value", "nan"))
        kw = dict(causal=c["causal"], window_size=c["window"], cu_seqlens=c["docs"])
        local = [ringlse.shard(t, c["layout"]) for t in (q, bad, v)]
        out, lse = ringlse.ring_attention(*local, layout=c["layout"], return_lse=True, backend="torch", **kw)
        out, lse = ringlse.unshard(out, c["layout"]), ringlse.unshard(lse, c["layout"], dim=2)
        r_out, r_lse = oracle(q, k, v, range(s), range(s), c["causal"], c["window"], c["docs"])
        hit = torch.zeros(4, s, dtype=torch.bool)  # [head, query row]: rows that see the NaN key
        for h in range(4):
            if h // 2 == c.get("head", 0):  # GQA 4 / 2: heads 2j, 2j+1 read kv head j
                hit[h, sorted(_sees(pos, s, c))] = True
        o, r_o = out[0].transpose(0, 1), r_out[0].transpose(0, 1)  # [head, row, d]
        where = f"rank {rank} {c}"
        if not (torch.equal(o.isnan().any(-1), hit) and o[hit].isnan().all()):
            failures.append(f"{where}: NaN output rows {o.isnan().any(-1).nonzero().tolist()}, "
                            f"expected {hit.nonzero().tolist()}")
        if not torch.equal(lse[0].isnan(), hit):
            failures.append(f"{where}: NaN lse rows {lse[0].isnan().nonzero().tolist()}")
        if not (o[~hit].isfinite().all() and lse[0][~hit].isfinite().all()):
            failures.append(f"{where}: rows that do not see the key are not finite")
        for name, a, b in (("out", o[~hit], r_o[~hit]), ("lse", lse[0][~hit], r_lse[0][~hit])):
            try:
                torch.testing.assert_close(a, b)
            except AssertionError as e:
                failures.append(f"{where}: {name} of rows that do not see the key: {str(e).splitlines()[0]}")
    return failures


def _sees(pos: int, s: int, c: dict) -> set[int]:
    """The query positions that see key `pos` (CONVENTIONS.md §10), written out plainly."""
    left, right = c["window"]
    docs = c["docs"] or [0, s]
    doc = lambda x: max(i for i in range(len(docs) - 1) if docs[i] <= x)  # noqa: E731
    return {p for p in range(s)
            if (not c["causal"] or pos <= p) and (left < 0 or pos >= p - left) and (right < 0 or pos <= p + right)
            and doc(pos) == doc(p)}


def deterministic_ring(rank, world, cases: list[dict]) -> list[str]:
    """The same ring call twice (torch backend): outputs, lse and gradients bitwise equal."""
    failures = []
    for c in cases:
        q, k, v, dout, dlse = random_inputs(1, c["s"], 4, 2, 16, c["dtype"], seed=c["seed"])
        runs = [ring_with_grads(q, k, v, dout, dlse, causal=c["causal"], layout=c["layout"], backend="torch",
                                return_lse=True) for _ in range(2)]
        for name, a, b in zip(NAMES, *runs):
            if not torch.equal(a, b):
                failures.append(f"rank {rank} {c}: {name} differs between two runs ({(a - b).abs().max().item():.3e})")
    return failures


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _live_rss_kib() -> int:
    """This process's RSS after a garbage collection and, with glibc, after returning freed heap pages
    (what is left is memory in use, not the allocator's spare)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _rss_kib()


def memory_flat(rank, world, calls: int, period: int, seed: int = 0) -> dict:
    """Ring calls (forward and backward) cycling through `period` drawn variants of lengths, heads,
    layouts, causality, windows and random documents (more distinct masks than the step-plan cache
    holds, so it keeps evicting): two cycles to warm up, then `calls` calls. Returns this rank's RSS
    and Python object count before and after, and the sizes of the ring's caches."""
    import gc
    import random

    from ringlse.ring import comm as comm_module
    from ringlse.ring import plan as plan_module

    rng = random.Random(seed)  # the same draws on every rank: the ranks must agree on every call

    def draw() -> tuple:
        n = 2 * rng.randint(1, 6)
        s = n * world
        kw = dict(causal=rng.random() < 0.5, layout=rng.choice(("contiguous", "zigzag", "stripe")))
        if rng.random() < 0.6:
            kw["cu_seqlens"] = [0, *sorted(rng.sample(range(1, s), rng.randint(0, min(3, s - 1)))), s]
        if rng.random() < 0.3:
            kw["window_size"] = (rng.randint(-1, 4), rng.randint(-1, 4))
        return n, rng.choice(((2, 1), (2, 2), (4, 2))), kw

    variants = [draw() for _ in range(period)]

    def one(i: int) -> None:
        n, (h, hkv), kw = variants[i % period]
        q = torch.randn(1, n, h, 8, requires_grad=True)
        k = torch.randn(1, n, hkv, 8, requires_grad=True)
        v = torch.randn(1, n, hkv, 8, requires_grad=True)
        out = ringlse.ring_attention(q, k, v, backend="torch", **kw)
        out.sum().backward()

    for i in range(2 * period):
        one(i)
    before = (_live_rss_kib(), len(gc.get_objects()))
    for i in range(calls):
        one(i)
    after = (_live_rss_kib(), len(gc.get_objects()))
    return dict(rss_kib=(before[0], after[0]), objects=(before[1], after[1]),
                step_plans=plan_module.step_plans.cache_info().currsize, comms=len(comm_module._COMMS))


def crossing_rings(rank, world) -> list[str]:
    """Two rings over the sub-groups {0, 1} and {2, 3} and a ring over the world, interleaved in the
    same processes (forward of one, forward of another, backward of both together): every result
    exact (float64) against the reference."""
    dist = torch.distributed
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    sub = groups[rank // 2]
    failures = []
    for it, (layout_sub, layout_world) in enumerate((("zigzag", "stripe"), ("stripe", "contiguous"),
                                                     ("contiguous", "zigzag"))):
        q_s, k_s, v_s, do_s, _ = random_inputs(1, 16, 4, 2, 8, torch.float64, seed=100 + 10 * it + rank // 2)
        q_w, k_w, v_w, do_w, _ = random_inputs(1, 24, 4, 2, 8, torch.float64, seed=200 + it)
        ls = [ringlse.shard(t, layout_sub, group=sub).requires_grad_() for t in (q_s, k_s, v_s)]
        lw = [ringlse.shard(t, layout_world).requires_grad_() for t in (q_w, k_w, v_w)]
        out_w1 = ringlse.ring_attention(*lw, causal=True, layout=layout_world, backend="torch")
        out_s = ringlse.ring_attention(*ls, causal=True, layout=layout_sub, group=sub, backend="torch")
        out_w2 = ringlse.ring_attention(*lw, causal=False, layout=layout_world, backend="torch")
        loss = ((out_s * ringlse.shard(do_s, layout_sub, group=sub)).sum()
                + ((out_w1 + 0.5 * out_w2) * ringlse.shard(do_w, layout_world)).sum())
        loss.backward()
        got = {
            "sub out": ringlse.unshard(out_s.detach(), layout_sub, group=sub),
            "world out causal": ringlse.unshard(out_w1.detach(), layout_world),
            "world out": ringlse.unshard(out_w2.detach(), layout_world),
            "sub dq": ringlse.unshard(ls[0].grad, layout_sub, group=sub),
            "sub dk": ringlse.unshard(ls[1].grad, layout_sub, group=sub),
            "world dv": ringlse.unshard(lw[2].grad, layout_world),
        }
        leaves_s = [t.clone().requires_grad_() for t in (q_s, k_s, v_s)]
        leaves_w = [t.clone().requires_grad_() for t in (q_w, k_w, v_w)]
        r_s, _ = ringlse.reference_attention(*leaves_s, causal=True, q_start=0, k_start=0)
        r_w1, _ = ringlse.reference_attention(*leaves_w, causal=True, q_start=0, k_start=0)
        r_w2, _ = ringlse.reference_attention(*leaves_w, causal=False)
        ((r_s * do_s).sum() + ((r_w1 + 0.5 * r_w2) * do_w).sum()).backward()
        want = {"sub out": r_s, "world out causal": r_w1, "world out": r_w2, "sub dq": leaves_s[0].grad,
                "sub dk": leaves_s[1].grad, "world dv": leaves_w[2].grad}
        for name, a in got.items():
            try:
                torch.testing.assert_close(a, want[name].detach())
            except AssertionError as e:
                failures.append(f"rank {rank} iteration {it} {name}: {str(e).splitlines()[0]}")
    return failures


def long_error(rank, world) -> str:
    """Rank 1 passes a layout name of 1,000 characters: every rank's message, with rank 1's text cut."""
    q = torch.randn(1, 4, 2, 8)
    try:
        ringlse.ring_attention(q, q, q, layout="x" * 1000 if rank == 1 else "stripe")
    except ValueError as e:
        return str(e)
    return "no error"


def host_check(rank, world, victim: int | None) -> dict:
    """The copy-engine transport's first-call host check (`use_copy_engines`) as an NCCL group's
    comm runs it, on the host over a gloo twin of the group (`RingComm.host_group`): with every rank,
    or with rank `victim` gone before it. CPU ranks stand in for the GPUs: the comm is told its group
    is NCCL's and K/V go by NCCL (`RINGLSE_KV_TRANSPORT=nccl`), so nothing touches a GPU."""
    import datetime
    import os

    from ringlse.ring.comm import RingComm
    from ringlse.ring.pull import use_copy_engines

    os.environ["RINGLSE_KV_TRANSPORT"] = "nccl"
    comm = RingComm(None)
    comm.backend = "nccl"
    comm._timeout = datetime.timedelta(seconds=10)  # the group's timeout, as an NCCL group would report it
    torch.distributed.barrier()
    if rank == victim:
        os._exit(0)
    got = _outcome(use_copy_engines, comm)
    return dict(got, same_host=comm.same_host, failed=comm.failed)


def ring_features(rank, world, cases: list[dict]) -> list[str]:
    """Rings with logit softcapping and a V head dim of its own on GPU ranks (`case`: backend, d, dv,
    softcap, layout; bf16, causal, GQA 8/2), gathered and judged on rank 0 by CONVENTIONS.md §7 against the
    float64 oracle of tests/test_kernels_softcap_dv.py (its bf16 run the baseline), with an lse gradient.
    Returns rank 0's failures."""
    from test_kernels_softcap_dv import _draw, _judge, causal_mask, oracle

    failures = []
    for case in cases:
        s, d, dv, cap, layout = case["s"], case["d"], case["dv"], case["softcap"], case["layout"]
        q, k, v, dout = _draw(1, s, s, 8, 2, d, dv, torch.bfloat16, rank_device(), seed=case["seed"])
        dlse = torch.randn(1, 8, s, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(q.device)
        local = [ringlse.shard(t, layout).detach().requires_grad_() for t in (q, k, v)]
        out, lse = ringlse.ring_attention(*local, causal=True, layout=layout, softcap=cap, backend=case["backend"],
                                          return_lse=True)
        loss = (out.double() * ringlse.shard(dout, layout).double()).sum()
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0).double() * ringlse.shard(dlse, layout, dim=2)).sum()
        grads = torch.autograd.grad(loss, local)
        ours = [ringlse.unshard(t.detach(), layout, dim=dim) for t, dim in zip((out, lse, *grads), (1, 2, 1, 1, 1))]
        if rank != 0:
            continue
        kw = dict(scale=d ** -0.5, softcap=cap, mask=causal_mask(s, s, 0, 0), dlse=dlse)
        try:
            _judge(ours, oracle(q, k, v, dout, **kw), oracle(q, k, v, dout, dtype=torch.bfloat16, **kw),
                   torch.bfloat16)
        except AssertionError as e:
            failures.append(f"{case}: {e}")
    return failures
