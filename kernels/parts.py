"""The launch skeleton shared by `sum_parts` and `merge_parts`: row-offset parts, at most `MAX_PARTS`
per launch (host code, no Triton).

Both kernels take a fixed number of part slots (a pointer per tensor of a part, its first row and its
row count); the launch's part count `N` is a compile-time constant, so slots past it are never read
and may hold any valid pointer. Their callers (`ringlse.merge`) keep at most `MAX_PARTS` parts
pending and fold longer lists into one part first.
"""

from __future__ import annotations

from collections.abc import Sequence

# part slots of one launch (the kernels' signatures spell out this many)
MAX_PARTS = 8


def part_slots(what: str, parts: Sequence[tuple], fill: tuple) -> list[list]:
    """The columns of `parts` (tuples `(start, tensor, ...)`), each padded to `MAX_PARTS` slots with
    its entry of `fill`, plus a last column of row counts (`tensor.shape[1]`, 0 for unused slots).

    Raises:
        ValueError: fewer than 1 or more than `MAX_PARTS` parts.
    """
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"{what}: 1 to {MAX_PARTS} parts per launch, got {len(parts)}")
    pad = MAX_PARTS - len(parts)
    columns = [list(col) + [f] * pad for col, f in zip(zip(*parts), fill)]
    lengths = [p[1].shape[1] for p in parts] + [0] * pad
    return columns + [lengths]
