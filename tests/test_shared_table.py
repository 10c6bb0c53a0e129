"""`SharedTable`, the ring agreement's table in host shared memory, driven from one process (its
use across processes is covered by every CPU ring test, which agree through it on one host)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ringlse.shared_table import SharedTable


def _tables(world: int, cols: int = 4) -> list[SharedTable]:
    memory = torch.zeros(2, world, cols + 1, dtype=torch.int64)  # what `create` maps from /dev/shm
    return [SharedTable(memory, r) for r in range(world)]


def test_rows_arrive_when_every_rank_posted():
    a, b, c = _tables(3)
    a.post(1, [0, 5, 6])
    b.post(1, [0, 5, 6])
    assert not a.arrived(1) and not c.arrived(1)
    c.post(1, [1, 7])
    assert a.arrived(1) and c.arrived(1)
    assert a.gather(1) == [[0, 5, 6, 0], [0, 5, 6, 0], [1, 7, 0, 0]]


def test_calls_alternate_slots_and_rows_are_cleared():
    a, b = _tables(2)
    for seq, row in ((1, [1, 2, 3, 4]), (2, [9]), (3, [5])):
        a.post(seq, row)
        assert not b.arrived(seq)
        b.post(seq, row)
        # call 3 reuses call 1's slots: nothing of call 1's longer row is left
        assert b.gather(seq) == [row + [0] * (4 - len(row))] * 2
    assert not a.arrived(4)


def test_a_rank_that_never_posts_times_out_by_name():
    a, b, c = _tables(3)
    a.post(1, [0])
    c.post(1, [0])
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not reach call 1"):
        a.gather(1, timeout_s=0.05)


def test_row_longer_than_the_table_is_refused():
    (a,) = _tables(1, cols=2)
    with pytest.raises(ValueError, match="row of 3 integers"):
        a.post(1, [1, 2, 3])


def _agreement_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("ringlse-agreement-*")} if shm.is_dir() else set()


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_create_leaves_no_file_behind(one_rank_group):
    before = _agreement_files()
    table = SharedTable.create(one_rank_group, 0, 0, cols=4)
    assert table is not None or platform.machine().lower() not in ("x86_64", "amd64")
    assert _agreement_files() == before


def test_a_failing_create_leaves_no_file_behind(one_rank_group, monkeypatch):
    """A collective that fails after the table's file exists (an object broadcast without numpy
    used to) must not leave the file in /dev/shm."""
    def broken(*args, **kwargs):
        raise RuntimeError("broadcast failed")

    before = _agreement_files()
    monkeypatch.setattr(dist, "broadcast", broken)
    with pytest.raises(RuntimeError, match="broadcast failed"):
        SharedTable.create(one_rank_group, 0, 0, cols=4)
    assert _agreement_files() == before
