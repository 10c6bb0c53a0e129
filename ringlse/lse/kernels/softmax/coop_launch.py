"""Host side of the cooperative kernels (`coop_kernels.py`): how a row is cut into pieces, how many
programs the GPU holds at once, whether the forward takes tasks or whole rows, and the launch that
takes fewer programs where the driver refuses a grid.

The grid must never exceed what the GPU holds at once: a program spins on the other pieces of its row,
and one that cannot start would keep it spinning forever. So the grid is sized from the compiled
kernel's occupancy (`occupancy.py`) and launched as a cooperative grid: the driver then places every
program at once or refuses the launch (without it, a program could spin on a piece that another kernel,
on another stream, keeps from being scheduled while that kernel waits the same way).
"""

from __future__ import annotations

import torch

from ringlse.kernels.host import cdiv, interpreting, next_power_of_2
from ringlse.kernels.launch import FREE, BoundLaunch
from ringlse.lse.kernels.occupancy import blocks_per_sm_by_driver, blocks_per_sm_by_rules

from .config import SoftmaxConfig
from .device import coop_words, num_sms, workspace

LOGSUMEXP = 2  # the forward kernels' MODE for logsumexp


class Replan(Exception):
    """A call plan's cooperative launch was refused down to fewer programs than one row's pieces: the
    call is planned again (`plan.PlanCache`), and the remembered grid caps then steer it elsewhere."""


def coop_plan(cfg: SoftmaxConfig, R: int, N: int, device: torch.device, which: str, itemsize: int = 4,
              tier: str = "") -> tuple[int, int, int, int | None] | None:
    """(pieces per row K, piece length, warps, register cap or None) for the cooperative `which`
    ("fwd"/"bwd") kernel on rows of N elements of `itemsize` bytes, from the constants of `tier` ("" or
    "_long"), or None where it does not apply (CPU, too few rows, no such tier; under the interpreter,
    unless `coop_max_programs` is set, and rows of more than one piece)."""
    if interpreting():
        if cfg.coop_max_programs is None:
            return None
    elif device.type != "cuda":
        return None
    # too few rows to keep every program busy spend longer waiting on the row's other pieces than they
    # save in memory traffic
    if R < cfg.coop_min_rows and not (which == "fwd" and R * N >= cfg.coop_min_elems_fwd):
        return None
    name = f"{which}{'_16' if itemsize <= 2 else ''}{tier}"
    piece, warps = getattr(cfg, f"coop_piece_{name}", None), getattr(cfg, f"coop_warps_{name}", None)
    if piece is None:
        return None
    # a row of more pieces than `coop_max_pieces` takes longer pieces (more warps, up to 8, then more
    # columns per thread): every program polls the words of all K pieces of its row
    grow = next_power_of_2(cdiv(cdiv(N, piece), cfg.coop_max_pieces))
    piece, warps = piece * grow, max(warps, min(8, warps * grow))
    if piece > 64 * 32 * warps:  # more than 64 columns per thread would spill registers
        return None
    # a row that leaves its last piece mostly empty holds registers the GPU could keep bytes in flight
    # with: pieces half as long (on half the warps), where that fills them better
    fill = lambda p: N / (cdiv(N, p) * p)  # noqa: E731
    halve = fill(piece) < cfg.coop_min_fill and fill(piece // 2) > fill(piece)
    # and the 2-byte forward on rows of few pieces (a row of one piece never waits on another)
    few = getattr(cfg, f"coop_min_pieces_{which}_16", None)
    halve = halve or (itemsize <= 2 and few is not None and 1 < cdiv(N, piece) < few)
    nreg = getattr(cfg, f"coop_maxnreg_{name}")
    if not tier and grow == 1 and halve:
        piece, warps = piece // 2, max(1, warps // 2)
        nreg = getattr(cfg, f"coop_maxnreg_{name}_halved", nreg)
    K = cdiv(N, piece)
    if interpreting() and K > 1:  # the interpreter runs programs in turn: a row's pieces would wait forever
        return None
    return K, piece, warps, int(nreg) if nreg else None


_RESIDENT: dict[tuple, int] = {}


def resident_programs(kernel, args: tuple, consts: dict, warps: int, device: torch.device) -> int:
    """How many programs of the compiled `kernel` the whole GPU holds at once (the driver's count, else
    its allocation rules: `occupancy.py`)."""
    # the specialisation key of the integer arguments: == 1, divisible by 16, or neither
    spec = tuple((a == 1, a % 16 == 0) for a in args if isinstance(a, int))
    dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
    key = (kernel.fn.__name__, tuple(sorted(consts.items())), spec, dtypes, warps, device.index)
    if key not in _RESIDENT:
        with torch.cuda.device(device):
            compiled = kernel.warmup(*args, grid=(1,), num_warps=warps, **consts)
            compiled._init_handles()
            shared = compiled.metadata.shared
            per_sm = blocks_per_sm_by_driver(compiled.function, warps, shared)
        if per_sm is None:
            props = torch.cuda.get_device_properties(device)
            per_sm = blocks_per_sm_by_rules(
                compiled.n_regs, warps, shared, regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
                threads_per_sm=getattr(props, "max_threads_per_multi_processor", 2048),
                smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 228 * 1024),
            )
        _RESIDENT[key] = per_sm * num_sms(device)
    return _RESIDENT[key]


def coop_grid(cfg: SoftmaxConfig, kernel, args: tuple, consts: dict, warps: int, R: int, K: int,
              device: torch.device) -> int | None:
    """Programs of a cooperative launch of the R * K tasks of K pieces per row: as many as the whole GPU
    holds at once (at most `coop_max_programs`), at most one a task, or None if one row's K programs
    cannot all be resident."""
    if interpreting():  # (`coop_plan` let rows of one piece through, with the cap set)
        resident = cfg.coop_max_programs
    else:
        resident = resident_programs(kernel, args, consts, warps, device)
        if cfg.coop_max_programs is not None:
            resident = min(resident, cfg.coop_max_programs)
    return min(R * K, resident) if resident >= K else None


def use_tasks(R: int, K: int, programs, logsumexp: bool) -> bool:
    """Whether the cooperative forward takes its tasks in turn over every resident program (TASKS), or
    runs whole rows in flight; `programs(tasks)` is the grid of either form (0: none fits). Tasks where
    they take fewer steps, and always for logsumexp, whose piece 0 alone waits and so falls behind the
    others when it is always the same program. Where the steps are as many, whole rows keep a piece's
    columns out of the loop."""
    if logsumexp:
        return True
    rows = programs(False) // K
    tasks = programs(True)
    return tasks >= K and (rows == 0 or cdiv(R * K, tasks) < cdiv(R, rows))


class CoopGrid:
    """The launches of one cooperative kernel plan over the most programs the driver accepts: from
    `programs` (or the count remembered for `key` in `caps`) down, halved at each refusal (a whole
    number of rows in flight unless `tasks`). A call returns False where even one row's K programs were
    refused (nothing ran then).

    Why: the driver may place fewer programs at once than `resident_programs` counted (seen on H200
    while that count ignored the per-sub-partition register files: `occupancy.py`). A refused launch is
    not a sticky CUDA error and runs nothing, so the words are as they were."""

    def __init__(self, kernel, args: tuple, programs: int, K: int, tasks: bool, num_warps: int, consts: dict,
                 key, caps: dict | None = None):
        self.kernel, self.args, self.programs, self.K, self.tasks = kernel, args, programs, K, tasks
        self.num_warps, self.consts, self.key = num_warps, consts, key
        self.caps = _CAPS if caps is None else caps
        self.bound: dict[int, BoundLaunch] = {}  # by number of programs, kept from call to call

    def most_programs(self) -> int:
        return min(self.programs, self.caps.get(self.key, self.programs))

    def __call__(self, *free) -> bool:
        programs = self.most_programs()
        while programs >= self.K:
            go = self.bound.get(programs)
            if go is None:
                go = self.bound[programs] = BoundLaunch(self.kernel, (programs,), *self.args,
                                                        num_warps=self.num_warps, **self.consts)
            try:
                go(*free)
            except RuntimeError as e:
                if "cooperative launch" not in str(e):
                    raise
                programs = programs // 2 if self.tasks else programs // self.K // 2 * self.K
                self.caps[self.key] = programs
                continue
            return True
        return False


# programs that the driver accepted after refusing more, per kernel specialisation
_CAPS: dict[tuple, int] = {}


def coop_choose(cfg: SoftmaxConfig, kernel, which: str, tensors: tuple, R: int, N: int, I: int, strides: tuple,
                consts: dict, per: int) -> tuple | None:
    """(programs, K, warps, launch options, grid key) of the plan a cooperative step takes, or None where
    no plan applies. The forward's programs may take the tasks in turn whatever their number
    (`use_tasks`); the backward's are a whole number of rows in flight.

    The first tier's plan is taken unless it cuts rows into more than `coop_long_pieces` pieces or
    leaves fewer than `coop_min_slots` rows in flight, and a "_long" plan (longer pieces, fewer
    registers per thread) exists that does better: every program polls and merges the words of all K
    pieces of its row, and rows of a million float32 columns fit only one at a time in the registers of
    1024-column pieces, where most of the GPU idles."""
    device = tensors[0].device
    chosen = None
    for tier in ("", "_long"):
        plan = coop_plan(cfg, R, N * per, device, which, tensors[0].element_size(), tier)
        if plan is None:
            continue
        K, piece, warps, nreg = plan
        c = dict(consts, PIECE=piece // per, KB=next_power_of_2(K))
        if "EVEN" in kernel.arg_names:
            c["EVEN"] = N % (piece // per) == 0
        # fewer registers per thread: more programs per SM, more bytes in flight. The 2-byte caps were
        # measured on rows read as pairs; element by element (odd lengths) the compiler needs more
        if nreg and (per > 1 or tensors[0].element_size() > 2):
            c["maxnreg"] = nreg
        c["launch_cooperative_grid"] = True
        words = torch.empty(64, dtype=torch.int64, device=device)  # (only its dtype and alignment count here)
        args = (*tensors, words, words, 3, R, N, I, *strides, K)  # (3: a placeholder for n_clear)
        if "TASKS" in kernel.arg_names:
            def programs_of(tasks: bool) -> int:
                return coop_grid(cfg, kernel, args, dict(c, TASKS=tasks), warps, R, K, device) or 0

            c["TASKS"] = use_tasks(R, K, programs_of, c.get("MODE") == LOGSUMEXP)
        programs = coop_grid(cfg, kernel, args, c, warps, R, K, device) or 0
        if not c.get("TASKS"):
            programs = programs // K * K
        key = (kernel.fn.__name__, K, warps, tuple(sorted(c.items())), device.index)
        programs = min(programs, _CAPS.get(key, programs))
        if chosen is None or programs // K > chosen[0] // chosen[1] or (programs >= K and K < chosen[1]):
            chosen = (programs, K, warps, c, key)
        if programs // K >= min(R, cfg.coop_min_slots) and K <= cfg.coop_long_pieces:
            break
    return chosen


def coop_step(cfg: SoftmaxConfig, kernel, which: str, tensors: tuple, R: int, N: int, I: int, strides: tuple,
              consts: dict, per: int = 1):
    """Plan time: a step `step(*tensors)` that runs the cooperative `kernel` (`which` = "fwd"/"bwd")
    over tensors of the layouts of `tensors`, with an int64 `[R, K]` word per piece, or None where no
    cooperative plan applies (the caller takes another path). `per` > 1: the kernel loads items of
    `per` elements, and N and the strides count items. The step raises `Replan` where the driver
    refused every grid down to one row's programs."""
    chosen = coop_choose(cfg, kernel, which, tensors, R, N, I, strides, consts, per)
    if chosen is None:
        return None
    programs, K, warps, c, key = chosen
    grid = CoopGrid(kernel, (*[FREE] * (len(tensors) + 3), R, N, I, *strides, K), programs, K,
                    bool(c.get("TASKS")), warps, c, key)
    if grid.most_programs() < K:
        return None

    def step(*ts: torch.Tensor) -> None:
        device = ts[0].device
        words, other, n_other, pool = coop_words(workspace(device), device, R * K)
        if not grid(*ts, words, other, n_other):
            raise Replan
        if pool is not None:
            pool.launched(R * K)

    return step
