"""The softmax launchers' constants, the winners of `benchmarks/lse_toolkit.py`'s sweeps on H200 (its
JSON records each variant timed), and the one way to change them: `config_override`.

A call plan depends on the active config and keys on it: a change takes effect at the next call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ringlse.lse.kernels.active_config import ActiveConfig


@dataclass(frozen=True)
class SoftmaxConfig:
    """Dispatch constants of `ringlse.lse.kernels.softmax`; `CONFIG` holds the measured values."""

    # rows held whole in registers (`row_kernels.py`)
    max_row_block: int = 32768  # forward: rows up to this many columns stay in registers
    max_row_block_16: int = 16384  # bf16/fp16: longer rows take the cooperative kernels, which read pairs
    max_row_block_bwd: int = 16384  # backward holds two rows (y and g)
    tile: int = 4096  # elements per program for short rows (several rows a program)
    short_cols: int = 1024  # rows of at most this many (padded) columns take `short_tile`...
    short_tile: int = 1024  # ... smaller tiles, of 2 warps
    # rows off 16-byte boundaries in whole 16-byte vectors, one per program (`fwd_rows_aligned_kernel`)
    aligned_rows_min_cols: int = 512  # from this many columns (shorter: the row kernel is faster)
    aligned_rows_wide_16: int = 16384  # 2-byte blocks of at least this many elements: 64 a thread, ...
    aligned_rows_wide_maxnreg: int = 80  # ... registers capped so that an SM holds three programs

    # long rows in two passes (`split_kernels.py`)
    chunk: int = 4096  # columns per step of the long-row loops
    chunk_warps: int = 8
    split_rows: int | None = None  # fewer rows than this split each row over programs; None: 2 x SMs

    # long rows as cooperative pieces in registers (`coop_kernels.py`): columns per program, warps,
    # register cap (None: as many as the compiler takes), per direction and dtype size
    coop_piece_fwd: int = 1024
    coop_warps_fwd: int = 2
    coop_maxnreg_fwd: int | None = None
    coop_piece_fwd_16: int = 2048  # 2-byte rows, read as words of two
    coop_warps_fwd_16: int = 1
    coop_maxnreg_fwd_16: int | None = 168  # three warps per scheduler where uncapped fitted two
    coop_maxnreg_fwd_16_halved: int | None = 96  # the cap of halved 2-byte forward pieces
    coop_piece_fwd_long: int = 4096  # float32 rows too long for `coop_min_slots` rows in flight
    coop_warps_fwd_long: int = 4
    coop_maxnreg_fwd_long: int | None = 128
    coop_piece_bwd: int = 4096  # the backward holds two inputs per piece
    coop_warps_bwd: int = 4
    coop_maxnreg_bwd: int | None = None
    coop_piece_bwd_16: int = 4096
    coop_warps_bwd_16: int = 4
    coop_maxnreg_bwd_16: int | None = None
    coop_min_rows: int = 64  # fewer rows wait on their other pieces longer than they save
    coop_min_elems_fwd: int = 1 << 25  # ... unless the forward has this many elements
    coop_min_slots: int = 2  # fewer rows in flight: try the "_long" pieces
    coop_long_pieces: int = 128  # more pieces a row: try the "_long" pieces
    coop_max_pieces: int = 512  # more pieces a row: longer pieces (every program polls all K words)
    coop_min_fill: float = 0.85  # a row filling its pieces less: pieces halved where that fills better
    coop_min_pieces_fwd_16: int = 17  # 2-byte forward rows of fewer pieces (but 2+): pieces halved
    # the most programs of a cooperative grid (None: as many as the GPU holds at once). Tests: a grid
    # that is no whole number of rows; and under the interpreter, which runs programs one after
    # another, the cooperative kernels run only with this set and one piece per row (a program would
    # otherwise wait on one that has not run)
    coop_max_programs: int | None = None
    # backward rows off 16-byte boundaries short enough for the row kernel take the aligned cooperative
    # kernel from this many columns (shorter: the row kernel is faster)
    aligned_min_cols: int = 4096
    aligned_min_cols_16: int = 1024

    def __post_init__(self):
        # plans key on the config: a hash computed once (hashing every field cost ~1.5 us a call)
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash


CONFIG = SoftmaxConfig()

_CONFIG = ActiveConfig(CONFIG)
# the config launches use now, and the one test-only way to change it (a context manager)
active_config = _CONFIG.get
config_override = _CONFIG.override
