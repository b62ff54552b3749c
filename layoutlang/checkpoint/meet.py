"""Where the ranks of a load or a save meet: one all-reduce of failure counts, under a deadline.

A load needs no meeting to be exact (every op is local) and a save needs two (the files
exist; every byte is written). Each is one small all-reduce on the group's own device (CPU
for gloo, the current accelerator for NCCL, so one code path serves both), waited for with
the caller's timeout: a rank that died or stalls makes the others raise `RefitError` within
it, never hang on the process group's own (much longer) timeout.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from ..diagnostics import UsageError
from ..runtime.errors import RefitError


def _device(group) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def failures(ok: bool, group, rank: int, phase: str, timeout: timedelta) -> int:
    """How many ranks of `group` did not succeed (0: all did); raises `RefitError` when the
    others do not arrive within `timeout`."""
    return int(summed(torch.tensor([0 if ok else 1], dtype=torch.int32), group, rank, phase, timeout)[0])


def summed(values: torch.Tensor, group, rank: int, phase: str, timeout: timedelta) -> torch.Tensor:
    """The sum of every rank's `values` (a CPU tensor, the same shape on every rank), as a
    new CPU tensor; raises `RefitError` when the others do not arrive within `timeout`."""
    import torch.distributed as dist

    flag = values.to(_device(group), copy=True)
    work = dist.all_reduce(flag, group=group, async_op=True)
    try:
        work.wait(timeout)
    except Exception as exc:  # noqa: BLE001 - a peer died or missed the deadline
        raise RefitError.at(rank, 0, phase, f"the other ranks did not meet within {timeout.total_seconds():g} s "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})",
                            reusable=False) from None
    return flag.cpu()


def as_timedelta(timeout: timedelta | float) -> timedelta:
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)



def rank_of(rank: int | None, group, ranks: int) -> int:
    """This process's rank in a load or save of a `ranks`-rank layout: the group's, checked against
    `rank=` when both are given; without a group, the default group's, or 0 alone."""
    if group is not None:
        import torch.distributed as dist

        got = dist.get_rank(group)
        if rank is not None and rank != got:
            raise UsageError(f"rank {rank}: the group says this rank is {got}")
        return got
    if rank is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        if ranks == 1:
            return 0
        raise UsageError(f"the layout has {ranks} ranks: pass rank= (or a group)")
    if not 0 <= rank < ranks:
        raise UsageError(f"rank {rank}: the layout has ranks 0..{ranks - 1}")
    return rank


__all__ = ["failures", "summed", "as_timedelta", "rank_of"]
