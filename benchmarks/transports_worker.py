"""One rank of the transports benchmark (benchmarks/transports.py starts it; see there).

Usage: python benchmarks/transports_worker.py JOB OUT   (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)

Every rank compiles the job's plan (2 trainer ranks -> 2 engine ranks), fills its
source shards with `layoutlang.runtime.fill.source_tensor` and times, in one gloo world,
turn by turn (`refit_gloo.round_order`), one refit per method and round:

  floor      the one-copy floor: each receiving rank copies every piece of the plan it
             receives straight out of its sender's tensor into its own destination with
             ONE `process_vm_readv` per piece (an iovec per contiguous run on each side),
             hand-written here (ctypes) from the senders' pids and tensor addresses, which
             the ranks exchange once before timing; senders do nothing but wait
  memory     `Refitter(plan, transport="memory", steady=True)`
  group      `Refitter(plan, transport="group", steady=True)` (gloo)
  nixl       `Refitter(plan, transport="nixl", steady=True)`, where the package is installed

With `"device": "cuda"` in the job (benchmarks/gpu_transports.py) the tensors live on the
rank's GPU (rank % device count), the floor is a device-to-device `copy_` of the bytes the
rank receives, "memory" is CUDA IPC, and "group" is NCCL where there is a GPU per rank.
Each step: barrier, clock, the method, barrier, clock (a step's time is the slowest
rank's). Then, untimed, per method: one more step into NaN-filled destinations; the first
method's result is checked element by element against the layout
(`layoutlang.runtime.fill.check_destination`), every other's must equal it bit for bit.
A method that cannot be built here (its transport not registered, its package missing,
the kernel refusing cross-memory reads) is reported with its reason, not timed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from refit_gloo import round_order  # noqa: E402

from layoutlang.compiler import compile_plan  # noqa: E402
from layoutlang.runtime import Refitter  # noqa: E402
from layoutlang.runtime.fill import check_destination, empty_destination, source_tensor  # noqa: E402


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_READV = _LIBC.process_vm_readv
_READV.restype = ctypes.c_ssize_t
_READV.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]


def _runs(box, shape, itemsize: int, base: int) -> list[tuple[int, int]]:
    """(address, bytes) of each contiguous run of a box of a C-order tensor at `base`, in C order."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    k = len(shape) - 1  # the innermost dim the box does not cover whole: runs go along it
    while k > 0 and tuple(box[k]) == (0, shape[k]):
        k -= 1
    length = (box[k][1] - box[k][0]) * strides[k] * itemsize
    starts = [sum(box[d][0] * strides[d] for d in range(len(shape)))]
    for d in range(k - 1, -1, -1):
        starts = [s + i * strides[d] for i in range(box[d][1] - box[d][0]) for s in starts]
    starts.sort()
    return [(base + s * itemsize, length) for s in starts]


class CopyFloor:
    """On an accelerator: each receiving rank copies as many bytes as it receives from one
    buffer of its device into another (`torch.Tensor.copy_`, device to device), the floor a
    same-device transport (CUDA IPC) is held to."""

    def __init__(self, plan, rank: int, device: torch.device):
        nbytes = sum(op.bytes for op in plan.ops_for_rank(rank) if op.dst_rank == rank and op.src_rank != rank)
        self.a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.b = torch.empty_like(self.a)

    def step(self) -> None:
        if self.a.numel():
            self.b.copy_(self.a)
        torch.cuda.synchronize()


class Floor:
    """Each receiving rank reads its pieces out of the senders' memory: one process_vm_readv per
    piece, the runs of both sides as iovecs (the kernel scatters them), no message, no staging."""

    def __init__(self, plan, rank: int, src: dict, dst: dict):
        world = dist.get_world_size()
        names = sorted(t.name for t in plan.src.tensors)
        table = torch.zeros(world, 1 + len(names), dtype=torch.int64)  # per rank: pid, each source's address
        table[rank, 0] = os.getpid()
        for i, n in enumerate(names):
            if n in src:
                table[rank, 1 + i] = src[n].data_ptr()
        dist.all_reduce(table)
        held = {t.name: t for t in plan.src.tensors}
        self.reads = []
        for op in plan.ops_for_rank(rank):
            if op.dst_rank != rank or op.src_rank == rank:
                continue
            s = held[op.src_name]
            shape = tuple(s.local_shape_at(op.src_rank))
            d = dst[op.dst_name]
            item = d.element_size()
            remote = _runs(op.src_slice, shape, item, int(table[op.src_rank, 1 + names.index(op.src_name)]))
            local = _runs(op.dst_slice, tuple(d.shape), item, d.data_ptr())
            assert len(local) <= 1024 and len(remote) <= 1024  # UIO_MAXIOV: one call per piece
            self.reads.append((int(table[op.src_rank, 0]), _iovecs(local), len(local), _iovecs(remote), len(remote),
                               sum(n for _, n in local)))

    def step(self) -> None:
        for pid, local, nl, remote, nr, want in self.reads:
            got = _READV(pid, local, nl, remote, nr, 0)
            if got != want:
                raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {want} bytes")


def _iovecs(runs: list[tuple[int, int]]):
    arr = (_Iovec * len(runs))()
    for i, (a, n) in enumerate(runs):
        arr[i].base, arr[i].len = a, n
    return arr


class Checks:
    """The untimed checks of a run's methods: the first method checked is checked against the
    layout element by element (`layout_errors()`, `check_destination`); every later one must
    equal it bit for bit (a full check of 1 GiB takes a minute a method on one core)."""

    def __init__(self, result: dict):
        self.result, self.reference = result, None

    def __call__(self, m: str, dst: dict, layout_errors) -> list[str]:
        if self.reference is None:
            errors = layout_errors()
            self.reference = None if errors else {n: v.clone() for n, v in dst.items()}
            self.result["checked_by_layout"] = m
            return errors
        return [f"{n} differs from {self.result['checked_by_layout']}'s (checked against the layout)"
                for n, v in dst.items() if not torch.equal(v.view(torch.int16), self.reference[n].view(torch.int16))]


def finish(result: dict, out_path: str) -> int:
    """Write the rank's result, leave the process group; the exit status."""
    Path(out_path).write_text(json.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0 if result["ok"] else 1


def _one_step(step) -> float:
    dist.barrier()
    t = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - t


def main(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    result: dict = {"rank": rank, "ok": False, "methods": {}, "skipped": {}}
    try:
        timeout = timedelta(seconds=job["timeout"])
        device = torch.device(job.get("device", "cpu"))
        backend = "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
            # NCCL needs a device per rank; with fewer, only the same-device transport runs
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]) else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        plan = compile_plan(job["src"], job["dst"])
        src = {t.name: source_tensor(t, rank, device) for t in plan.src.tensors
               if rank < plan.src.ranks and t.holds(rank)}
        dst_ts = [t for t in plan.dst.tensors if rank < plan.dst.ranks and t.holds(rank)]
        dst = {t.name: empty_destination(t, device) for t in dst_ts}
        result["bytes"] = plan.stats["network_bytes"]
        result["device"] = str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
        floor = Floor(plan, rank, src, dst) if device.type == "cpu" else CopyFloor(plan, rank, device)
        run = {"floor": floor.step}
        for name in job["methods"]:
            if name == "floor":
                continue
            if name == "group" and device.type == "cuda" and backend == "gloo":
                result["skipped"][name] = (f"NCCL needs one device per rank: {torch.cuda.device_count()} device(s) "
                                           f"for {os.environ['WORLD_SIZE']} ranks")
                continue
            # every rank decides alike: a transport that fails to build on any rank is skipped on all
            refitter, why = None, ""
            try:
                refitter = Refitter(plan, timeout=timeout, steady=True, transport=name)
            except Exception as exc:  # noqa: BLE001 - reported as the method's reason
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            failed = torch.tensor([0 if refitter is not None else 1])
            dist.all_reduce(failed)
            if int(failed):
                result["skipped"][name] = why or "it could not be built on another rank"
                continue
            run[name] = (lambda r=refitter: r.refit(src or None, dst or None))
        order = list(run)
        times = {m: [] for m in order}
        last = None
        for i in range(1 + job["rounds"]):
            for m in round_order(order, i, last):
                t = _one_step(run[m])
                if i:  # round 0 warms every method up
                    times[m].append(t)
                last = m
        checks = Checks(result)
        for m in order:
            for t in dst_ts:
                dst[t.name].fill_(float("nan"))
            run[m]()
            dist.barrier()
            if m == "floor" and device.type != "cpu":  # a copy of bytes, not the refit: nothing to check
                errors = []
            else:
                errors = checks(m, dst, lambda: [e for t in dst_ts
                                                 for e in [check_destination(t, rank, dst[t.name].cpu(), plan)] if e])
            result["methods"][m] = {"seconds": times[m], "errors": errors[:3]}
        result["ok"] = True
    except Exception:  # noqa: BLE001 - the launcher prints it
        result["error"] = traceback.format_exc()
    return finish(result, out_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
