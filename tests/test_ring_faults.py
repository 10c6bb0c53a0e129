"""Faults, load and bad input on spawned gloo ranks: a rank that dies or stalls makes every survivor
raise a RuntimeError naming the phase, the step and the peer, in time (never a result without every
block); bad input raises the same ValueError on every rank; NaN keys reach only the rows that see
them; memory stays flat over many calls; rings on different groups never cross; the torch backend is
deterministic. docs/failures.md states what these tests check."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ring_workers as rw
import ringlse
from dist_harness import RankPool, run_ranks
from mask_oracle import oracle

W = 3
VICTIM = 1
FAULT_RE = rw.FAULT_RE


@pytest.fixture(scope="module")
def pool2(tmp_path_factory):
    # torch's flight recorder (a bounded ring buffer of the latest collectives and transfers) grows
    # RSS by ~2 MB over the first ~2,500 ring calls and then stays flat (measured): off here, so that
    # the memory test sees ringlse's own memory within its 30 s
    with RankPool(2, tmp_path_factory.mktemp("pool2"), env={"TORCH_FR_BUFFER_SIZE": "0"}) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool3(tmp_path_factory):
    with RankPool(3, tmp_path_factory.mktemp("pool3")) as pool:
        yield pool


# --- a rank dies or stalls ---------------------------------------------------------------------------------------

# (where, action, ring timeout=, phases the survivors may name, bound on a survivor's time in seconds)
# A dead peer on this host closes its connections: gloo reports that at once, so the exits use the
# group's timeout (60 s) and must still be noticed within seconds. The stalls pass a short timeout=.
FAULTS = {
    "exit-before-agreement": ("agreement", "exit", None, {"agreement"}, 10.0),
    "exit-in-forward": ("forward", "exit", None, {"forward", "backward"}, 10.0),
    "exit-in-backward": ("backward", "exit", None, {"backward"}, 10.0),
    "stall-in-forward": ("forward", "stall", 2.0, {"forward", "backward"}, 2.0 + 5.0),
    "stall-before-agreement": ("agreement", "stall", 2.0, {"agreement"}, 2.0 + 5.0),
}


@pytest.mark.parametrize("name", list(FAULTS))
def test_survivors_raise_naming_step_and_peer_in_time(name, tmp_path):
    where, action, timeout, phases, bound = FAULTS[name]
    # exits in forward/backward (W = 3, contiguous, non-causal) happen in the block op's second call:
    # step 1 (after the own block), in the middle of the ring
    per_rank = run_ranks(rw.ring_fault, W, tmp_path, VICTIM, where, action, timeout, 30.0,
                         pg_timeout=60.0, may_exit=[VICTIM], hard_exit=True, timeout=120)
    survivors = {r: o for r, o in enumerate(per_rank) if r != VICTIM}
    named = []
    for rank, got in survivors.items():
        assert not got["returned"], f"{name}: rank {rank} returned a result ({got})"
        assert got["type"] == "RuntimeError", f"{name}: rank {rank}: {got}"
        m = FAULT_RE.match(got["message"])
        assert m, f"{name}: rank {rank}: message does not name phase, step and peer: {got['message']!r}"
        assert m.group(1) in phases, f"{name}: rank {rank}: {got['message']!r}"
        assert got["cause"] is not None, f"{name}: rank {rank}: the transport's error is not kept as __cause__"
        assert got["elapsed"] < bound, f"{name}: rank {rank} raised after {got['elapsed']:.1f} s (bound {bound} s)"
        named.append(m.group(3))
        # the group is refused from now on, at once (messages of the failed call may still arrive)
        again = got["again"]
        assert again is not None and again["type"] == "RuntimeError", f"{name}: rank {rank}: second call {again}"
        assert "earlier call on this process group failed" in again["message"] and again["elapsed"] < 1.0
    if action == "exit":
        # every survivor names the dead rank; one that reached its exchange after another survivor had
        # raised and left names that survivor too ("ranks 0, 1"), which is as true
        ranks = [set(int(x) for x in n.split(" ", 1)[1].split(", ")) for n in named]
        assert all(VICTIM in r for r in ranks), f"{name}: survivors named {named}"
    else:  # a survivor may time out waiting for another survivor that waits for the stalled rank
        assert f"rank {VICTIM}" in named, f"{name}: no survivor named the stalled rank: {named}"


# --- bad input ---------------------------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_bad_input_raises_the_same_value_error_on_every_rank(pool3, seed):
    """Each rank draws its own input (from the seed and its rank), some wrong in one way each: every
    rank raises one ValueError, the same text everywhere, naming exactly the ranks that were wrong."""
    results = pool3.run(rw.bad_input_fuzz, seed, timeout=60)
    assert [r["type"] for r in results] == ["ValueError"] * W, results
    messages = {r["message"] for r in results}
    assert len(messages) == 1, f"ranks raised different messages: {messages}"
    message = messages.pop()
    assert message.startswith("ring_attention: invalid input: rank "), message
    for rank, r in enumerate(results):
        assert (f"rank {rank}: " in message) == (r["kind"] != "good"), (rank, r["kind"], message)


def test_disagreeing_ranks_get_the_same_message_naming_the_fields(pool3):
    per_rank = pool3.run(rw.disagreeing_ranks, timeout=60)
    for i in range(2):
        assert len({messages[i] for messages in per_rank}) == 1, [m[i] for m in per_rank]
    length, causal = per_rank[0]
    assert "ranks disagree" in length and "q shape: (1, 8, 2, 8) on rank 0, (1, 4, 2, 8) on ranks 1, 2" in length
    assert "causal: False on ranks 0, 2, True on rank 1" in causal


def test_long_error_texts_are_cut_to_300_bytes(pool3):
    messages = pool3.run(rw.long_error, timeout=60)
    assert len(set(messages)) == 1, messages
    prefix = "ring_attention: invalid input: rank 1: "
    assert messages[0].startswith(prefix + "unknown layout 'xxx") and messages[0].endswith("xxx...")
    assert len(messages[0].encode()) == len(prefix) + 300


def test_the_agreement_decides_from_rows_and_texts_alone():
    from ringlse.ring.agreement import decide

    with pytest.raises(ValueError, match=r"^ring_attention: invalid input: rank 1: y; rank 2: invalid input$"):
        decide([[0, 5], [1, -1], [1, -1]], ["", "ring_attention: y", ""])
    with pytest.raises(ValueError, match="field 0: 5 on ranks 0, 2, 6 on rank 1"):
        decide([[0, 5], [0, 6], [0, 5]], None)
    decide([[0, 5], [0, 5]], None)


def test_the_agreement_row_round_trips():
    """`AgreementRow.to_row()` / `from_row()` are inverses, every row has the same length (the exchange
    needs it), and a disagreement names fields, not indices."""
    from ringlse.masks import Rule
    from ringlse.ring.agreement import AgreementRow, decide, describe_row

    q, k = torch.zeros(2, 12, 4, 16, dtype=torch.bfloat16), torch.zeros(2, 12, 2, 16, dtype=torch.bfloat16)
    v = torch.zeros(2, 12, 2, 8, dtype=torch.bfloat16)
    rows = [AgreementRow.of_call(q, k, k, True, "zigzag", 0.25, False, True, Rule(True, (8, 0), (0, 5, 24))),
            AgreementRow.of_call(q, k, k, False, "stripe", 16**-0.5, True, False, Rule(False)),
            AgreementRow.invalid(),
            AgreementRow.of_call(q, k, k, True, "zigzag", 0.25, False, True, Rule(True, (8, 0), (0, 5, 24)),
                                 softcap=30.0),
            AgreementRow.of_call(q, k, v, True, "zigzag", 0.25, False, True, Rule(True, (8, 0), (0, 5, 24)))]
    for row in rows:
        ints = row.to_row()
        assert all(isinstance(x, int) for x in ints) and len(ints) == len(rows[0].to_row())
        assert AgreementRow.from_row(ints) == row
        assert AgreementRow.from_row(torch.tensor(ints).tolist()) == row  # as the exchange returns them
    described = rows[0].describe()
    assert described["layout"] == "zigzag" and described["dtype"] == "torch.bfloat16"
    assert described["K/V transport"] == "copy engines" and described["window_size"] == "(8, 0)"
    assert described["documents"].startswith("3 boundaries")
    assert set(rows[2].describe().values()) == {"(invalid)"}
    with pytest.raises(ValueError, match=r"causal: True on rank 0, False on rank 1"):
        decide([[0, *rows[0].to_row()], [0, *rows[1].to_row()]], None, describe_row)
    assert rows[3].describe()["softcap"] == "30" and rows[0].describe()["softcap"] == "0"
    with pytest.raises(ValueError, match=r"softcap: 0 on rank 0, 30 on rank 1"):
        decide([[0, *rows[0].to_row()], [0, *rows[3].to_row()]], None, describe_row)
    assert rows[4].describe()["V head dim"] == "8" and rows[0].describe()["V head dim"] == "16"
    with pytest.raises(ValueError, match=r"V head dim: 16 on rank 0, 8 on rank 1"):
        decide([[0, *rows[0].to_row()], [0, *rows[4].to_row()]], None, describe_row)


class _FakeWork:
    def __init__(self, outcome):
        self.outcome, self.timeouts = outcome, []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def test_wait_names_step_and_peer_and_marks_the_group_failed():
    """`RingComm.wait` on stand-in works: a failure or a `False` from `Work.wait` becomes the
    RuntimeError of docs/failures.md (original as `__cause__`); a coalesced work (NCCL batches) names
    every peer of its batch; the comm then refuses further calls."""
    import datetime

    from ringlse.ring.comm import Pending, RingComm

    comm = RingComm(None)
    comm.rank, comm.world, comm.global_ranks = 1, 3, [5, 6, 7]
    ok, boom = _FakeWork(True), _FakeWork(OSError("boom"))
    with pytest.raises(RuntimeError, match=r"^ring_attention: forward step 4: waiting for rank 2 \(global 7\): boom$") as e:
        comm.wait([Pending(ok, (0,), 4), Pending(boom, (2,), 4)], "forward", datetime.timedelta(seconds=3))
    assert isinstance(e.value.__cause__, OSError)
    assert 0 < ok.timeouts[0].total_seconds() <= 3 and 0 < boom.timeouts[0].total_seconds() <= 3
    with pytest.raises(RuntimeError, match="earlier call on this process group failed.*forward step 4"):
        comm.check_usable()
    comm.failed = None
    with pytest.raises(RuntimeError, match=r"backward step 2: waiting for ranks 0, 2 \(global 5, 7\): not done") as e:
        comm.wait(RingComm._pending([_FakeWork(False)], [2, 0], 2), "backward", datetime.timedelta(seconds=1))
    assert isinstance(e.value.__cause__, TimeoutError)
    comm.failed = None
    nccl_style = _FakeWork(True)
    comm.wait([Pending(nccl_style, (0,), 1)], "forward", None)  # no limit: Work.wait() as it is
    assert nccl_style.timeouts == [None] and comm.failed is None


def test_a_batch_that_cannot_be_posted_names_phase_step_and_peers(monkeypatch):
    """gloo raises at once when a peer is gone as a batch is posted, before any wait: that too is the
    RuntimeError of docs/failures.md, naming the phase, the step and the batch's peers (a survivor of a
    rank that exited had raised gloo's own "Connection reset by peer" from the post), and the comm refuses
    further calls; the agreement's exchange likewise."""
    import datetime

    import torch.distributed as dist

    from ringlse.ring.comm import RingComm

    comm = RingComm(None)
    comm.rank, comm.world, comm.global_ranks = 1, 3, [5, 6, 7]
    comm.next, comm.prev, comm._group_ref, comm.backend = 7, 5, None, "gloo"

    def reset(ops):
        raise RuntimeError("Read error [127.0.0.1]:60811: Connection reset by peer")

    monkeypatch.setattr(dist, "P2POp", lambda *op: op)  # (its checks need an initialised group)
    monkeypatch.setattr(dist, "batch_isend_irecv", reset)
    t = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"^ring_attention: forward step 2: waiting for ranks 0, 2 \(global 5, 7\): "
                       r"Read error .*Connection reset by peer$") as e:
        comm.exchange(t, torch.empty(3), step=2, phase="forward")
    assert FAULT_RE.match(str(e.value)) and isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="earlier call on this process group failed.*forward step 2"):
        comm.check_usable()
    comm.failed = None
    with pytest.raises(RuntimeError, match=r"^ring_attention: backward step 1: waiting for rank 2 \(global 7\): "):
        comm.send_recv([t], 2, [], 0, step=1, phase="backward")
    # the agreement's all-to-all likewise
    comm.failed = None
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **kw: reset(None))
    with pytest.raises(RuntimeError, match=r"^ring_attention: agreement step 0: waiting for ranks 0, 2 \(global 5, 7\): "
                       r"Read error"):
        comm.post_agreement([1, 2, 3], None, datetime.timedelta(seconds=1))


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), 1e300, "1s", True])
def test_timeout_must_be_positive(timeout):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="invalid input: rank 0: timeout "):
        ringlse.ring_attention(q, q, q, timeout=timeout)


def test_timeout_accepts_seconds_and_timedelta():
    import datetime

    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    ref = ringlse.ring_attention(q, q, q, causal=True)
    for timeout in (5, 0.25, datetime.timedelta(seconds=3)):
        assert torch.equal(ringlse.ring_attention(q, q, q, causal=True, timeout=timeout), ref)


# --- NaN and infinities ------------------------------------------------------------------------------------------


def _nan_cases(world: int) -> list[dict]:
    s = 4 * world * 3
    docs = [0, 5, s // 2 + 1, s]
    cases = []
    for layout in ("contiguous", "zigzag", "stripe"):
        for causal, window, bounds, pos in ((True, (-1, -1), None, 7), (True, (-1, -1), docs, 6),
                                            (False, (2, 3), docs, s // 2 + 3), (False, (-1, -1), None, 0)):
            cases.append(dict(s=s, layout=layout, causal=causal, window=window, docs=bounds, pos=pos,
                              head=len(cases) % 2, seed=len(cases)))
    return cases


def test_nan_key_reaches_only_the_rows_that_see_it_through_the_ring(pool2):
    failures = [f for fs in pool2.run(rw.nan_key_rows, _nan_cases(2), timeout=120) for f in fs]
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("case", _nan_cases(1)[:4], ids=lambda c: f"causal{c['causal']}-w{c['window']}-docs{bool(c['docs'])}")
def test_nan_key_reaches_only_the_rows_that_see_it_on_one_device(case):
    s, pos, head = case["s"], case["pos"], case["head"]
    q, k, v, _, _ = rw.random_inputs(1, s, 4, 2, 8, torch.float64, seed=case["seed"])
    bad = k.clone()
    bad[0, pos, head, 3] = float("nan")
    kw = dict(causal=case["causal"], window_size=case["window"], cu_seqlens=case["docs"])
    out, lse = ringlse.attention(q, bad, v, return_lse=True, backend="torch", **kw)
    r_out, r_lse = oracle(q, k, v, range(s), range(s), case["causal"], case["window"], case["docs"])
    hit = torch.zeros(4, s, dtype=torch.bool)
    hit[2 * head:2 * head + 2, sorted(rw._sees(pos, s, case))] = True
    o = out[0].transpose(0, 1)
    assert torch.equal(o.isnan().any(-1), hit) and o[hit].isnan().all()
    assert torch.equal(lse[0].isnan(), hit)
    torch.testing.assert_close(o[~hit], r_out[0].transpose(0, 1)[~hit])
    torch.testing.assert_close(lse[0][~hit], r_lse[0][~hit])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_infinite_key_scores_infinite_only_in_the_rows_that_see_it(sign):
    """A `±inf` key component: each row that sees the key scores `±inf` by the sign of `q·k` (`+inf`:
    the row and its lse are NaN; `-inf`: the key drops out, the row stays finite); other rows are exact."""
    case = dict(s=12, causal=True, window=(-1, -1), docs=[0, 3, 12])
    s, pos = case["s"], 5
    q, k, v, _, _ = rw.random_inputs(1, s, 2, 1, 8, torch.float64, seed=4)
    bad = k.clone()
    bad[0, pos, 0, 3] = sign * float("inf")
    out, lse = ringlse.attention(q, bad, v, return_lse=True, backend="torch", causal=True, cu_seqlens=case["docs"])
    r_out, r_lse = oracle(q, k, v, range(s), range(s), True, (-1, -1), case["docs"])
    sees = rw._sees(pos, s, case)
    for p in range(s):
        for h in range(2):
            if p not in sees:
                torch.testing.assert_close(out[0, p, h], r_out[0, p, h])
                torch.testing.assert_close(lse[0, h, p], r_lse[0, h, p])
            elif sign * q[0, p, h, 3] > 0:
                assert out[0, p, h].isnan().all() and lse[0, h, p].isnan(), (p, h)
            else:
                assert out[0, p, h].isfinite().all() and lse[0, h, p].isfinite(), (p, h)


def test_nan_query_reaches_only_its_row():
    q, k, v, _, _ = rw.random_inputs(1, 10, 2, 1, 8, torch.float64, seed=6)
    ref, ref_lse = ringlse.attention(q, k, v, causal=True, return_lse=True, backend="torch")
    q[0, 4, 1, 2] = float("nan")
    out, lse = ringlse.attention(q, k, v, causal=True, return_lse=True, backend="torch")
    hit = torch.zeros(10, 2, dtype=torch.bool)
    hit[4, 1] = True
    assert torch.equal(out[0].isnan().any(-1), hit) and torch.equal(lse[0].isnan().T, hit)
    torch.testing.assert_close(out[0][~hit], ref[0][~hit])
    torch.testing.assert_close(lse[0].T[~hit], ref_lse[0].T[~hit])


def test_rows_that_see_nothing_stay_empty_next_to_a_nan_key():
    """Bottom-right causal with more queries than keys: the first rows see no key; with a NaN key
    they stay (0, -inf) (CONVENTIONS.md §2; gradients through NaN inputs are unspecified)."""
    q, k, v, _, _ = rw.random_inputs(1, 6, 2, 2, 8, torch.float64, seed=3)
    k, v = k[:, :4].clone(), v[:, :4].clone()
    k[0, 0, 0, 0] = float("nan")
    out, lse = ringlse.attention(q, k, v, causal=True, return_lse=True, backend="torch")
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    assert torch.equal(lse[0, :, :2], torch.full_like(lse[0, :, :2], float("-inf")))
    assert out[0, 2:, 0].isnan().all() and out[0, 2:, 1].isfinite().all()  # head 0 sees key 0, head 1 is clean


# --- load: memory, concurrent rings, determinism -----------------------------------------------------------------


def test_host_memory_is_flat_over_many_ring_calls(pool2):
    """1,000 ring calls (forward and backward) cycling through 100 variants of lengths, heads, layouts,
    windows and random documents (more masks than the step-plan cache keeps), after two cycles: RSS
    and the Python object count stay flat, every cache bounded (step plans: an LRU of 64; comms: one
    per live group). Measured: +0.2 MiB RSS over the first 1,000, ~0 after; objects +0."""
    per_rank = pool2.run(rw.memory_flat, 1000, 100, timeout=120)
    for rank, r in enumerate(per_rank):
        (rss0, rss1), (obj0, obj1) = r["rss_kib"], r["objects"]
        assert rss1 - rss0 < 2048, f"rank {rank}: RSS grew {rss1 - rss0} KiB over 1000 calls ({r})"
        assert obj1 - obj0 < 100, f"rank {rank}: {obj1 - obj0} more Python objects after 1000 calls ({r})"
        assert r["step_plans"] <= 64 and r["comms"] == 1, r


def test_rings_on_different_groups_never_cross(tmp_path):
    failures = [f for fs in run_ranks(rw.crossing_rings, 4, tmp_path, timeout=180) for f in fs]
    assert not failures, "\n".join(failures[:10])


def test_torch_backend_ring_is_deterministic(pool2):
    cases = [dict(s=24, dtype=dt, causal=c, layout=lay, seed=9)
             for dt in (torch.float32, torch.bfloat16) for c, lay in ((True, "zigzag"), (False, "stripe"))]
    failures = [f for fs in pool2.run(rw.deterministic_ring, cases, timeout=120) for f in fs]
    assert not failures, "\n".join(failures)


def test_the_host_check_runs_on_the_host_and_names_a_dead_rank(tmp_path):
    """The copy-engine transport asks once per group whether every rank shares this host. It asks
    over the agreement's gloo group, not by an NCCL collective (one of those, with a rank dead before
    the group's first ring call, left the survivor waiting on the GPU past the watchdog on 2xH100):
    with every rank it answers, with one gone the others raise the agreement's RuntimeError within
    the group's timeout (10 s here)."""
    ok = run_ranks(rw.host_check, 2, tmp_path, None, timeout=60)
    assert all(r["returned"] and r["same_host"] is True and r["failed"] is None for r in ok), ok
    got = run_ranks(rw.host_check, 2, tmp_path, 1, may_exit=[1], hard_exit=True, timeout=60)[0]
    assert not got["returned"] and got["type"] == "RuntimeError", got
    m = FAULT_RE.match(got["message"])
    assert m and m.group(1) == "agreement" and m.group(3) == "rank 1", got
    assert got["elapsed"] < 10.0 + 5.0 and got["failed"] is not None, got
