"""One rank of a local refit job (see launch.py). Usage: python -m layoutlang.runtime.worker JOB OUT

The job (JSON) names the two layouts and their args, and optionally a
budget, `verify`, `overlap`, `keep_staging`, `steady`, a number of `steps`, `timeout` (the Refitter's, seconds),
`pg_timeout` (the process group's; by default far above `timeout`, so that
nothing can lean on it), `strided` (every tensor is a strided view into a
bigger buffer whose other elements are guards that must stay untouched),
`groups` (lists of global ranks: each rank refits in the sub-group that holds it, the
plan's ranks being that group's ranks; ranks in none only create the groups; every rank meets the others once more before it exits, so that rank 0's store outlives every group), `retry` (after a failed refit, call refit once more and report what it said),
`transport` (the Refitter's: "group" when the job names none, so the tests' jobs cover the
process group, `layoutc run` passes its `--transport`, "auto" by default; `transport_options`: keyword arguments of its
class, e.g. {"mode": "ring"} for "memory"), `linger` (seconds to stay alive after reporting, so rank 0's store outlives a late rank;
2 s after a failure by default), `store_linger` (seconds rank 0 lingers beyond that), `alternate` (plain tensors only: the sources hold their
fill in odd steps and zeros in even ones, written in place, and every step's destination is
checked: a step that moved nothing, or stale bytes, fails), `release` (steps before which
the rank calls `Refitter.release_staging()`),
and test faults, each `{"rank": R, ...}`: `die` (exit `after` seconds into
`bucket` of `step`; `kill`: by SIGKILL), `die_before` (exit `after` seconds into `step`), `stall` (sleep
`seconds` at the start of `bucket`), `stall_before` (sleep `seconds` before
calling refit for `step`), `corrupt` (change one element of a send buffer),
`wrong_shape` (pass a truncated source tensor from `step` on, 1 by default), `odd_args` (compile another
plan). Faults go through `RefitHooks`, never by patching the runtime; a rank without one
of its own gets no hooks (so its steady steps may be replayed: layoutlang/runtime/replay.py).

A worker exits when its launcher dies (parent-death signal on Linux, and a
watch on the parent's pid everywhere).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .refit import RefitHooks

# Guard values around strided views: exact in their dtype, never a fill value.
GUARD = {torch.uint8: 201.0, torch.float8_e4m3fn: 256.0, torch.float8_e5m2: 256.0}
FAULTS = ("die", "die_before", "stall", "stall_before", "corrupt", "wrong_shape")


def main(job_path: str, out_path: str) -> int:
    exit_with_launcher()
    if os.environ.get("LAYOUTLANG_PID_DIR"):  # test seam: who to look for after killing the launcher
        with open(os.path.join(os.environ["LAYOUTLANG_PID_DIR"], f"{os.environ['RANK']}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
    job = json.loads(open(job_path).read())
    rank = int(os.environ["RANK"])
    result: dict = {"rank": rank, "ok": False}
    try:
        # far above the Refitter's timeout: no result may lean on the process group's own
        pg_timeout = timedelta(seconds=job.get("pg_timeout", max(600, 10 * job.get("timeout", 60))))
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=pg_timeout)
        groups = [(members, dist.new_group(members)) for members in job.get("groups", [])]  # all ranks call
        mine = [(members, g) for members, g in groups if rank in members]
        if not groups:
            result.update(run(job, rank))
        elif mine:  # the plan's ranks are ranks of the sub-group
            group = mine[0][1]
            result.update(run(job, dist.get_rank(group), group))  # torch orders a group's ranks
        else:
            result.update({"outside_group": True, "check_errors": []})
        result["ok"] = not result.get("check_errors") and not result.get("error")
    except Exception as exc:  # noqa: BLE001 - reported to the launcher as data
        result["error"] = f"{type(exc).__name__}: {exc}"
    with open(out_path, "w") as fh:
        json.dump(result, fh)
    if job.get("groups") and dist.is_initialized():
        # sub-groups finish independently, and rank 0 hosts the store: it must not leave while
        # another group still meets there (a bounded barrier: a failed rank does not hang it)
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=60), wait_all_ranks=True)
        except Exception:  # noqa: BLE001 - the results are written; a missing rank was reported
            pass
    # rank 0 hosts the store: a failed rank 0 that left at once would turn its peers' reasons
    # into "store unreachable" (docs/runtime.md); so a failed worker lingers a little
    # (`store_linger`: rank 0 stays that much longer than the others, so that a survivor freed
    # only by another survivor's exit still finds that one's reason in the store)
    time.sleep(job.get("linger", 0 if result["ok"] else 2) + (job.get("store_linger", 0) if rank == 0 else 0))
    if not result["ok"]:
        sys.stderr.flush()
        os._exit(1)  # transfers may be in flight: do not wait on the process group at exit
    dist.destroy_process_group()
    return 0


def exit_with_launcher() -> None:
    """Die with the launcher: a killed `layoutc run` must not leave workers behind."""
    launcher = int(os.environ.get("LAYOUTLANG_LAUNCHER_PID", "0"))
    if not launcher:
        return
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != launcher:  # the launcher died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()


def run(job: dict, rank: int, group=None) -> dict:
    from layoutlang.compiler import compile_plan
    from .errors import RefitError
    from .fill import check_destination, empty_destination, source_tensor
    from .refit import Refitter

    dst_args = job.get("dst_args")
    odd = job.get("odd_args")  # test fault: one rank compiles with other args
    if odd and odd["rank"] == rank:
        dst_args = {**(dst_args or {}), **odd["dst_args"]}
    plan = compile_plan(job["src"], job["dst"], args=job.get("args"), src_args=job.get("src_args"),
                        dst_args=dst_args, ranks_per_node=job.get("ranks_per_node"), wire=job.get("wire", "auto"),
                        relay=job.get("relay", True))
    refitter = Refitter(plan, group=group, budget_bytes=job.get("budget"),
                        timeout=timedelta(seconds=job.get("timeout", 60)), verify=job.get("verify", False),
                        hooks=FaultHooks(job, rank) if FaultHooks.any_for(job, rank) else None,
                        overlap=job.get("overlap", False),
                        keep_staging=job.get("keep_staging"), steady=job.get("steady", False),
                        transport=_transport(job, group))
    src = {t.name: source_tensor(t, rank) for t in plan.src.tensors if rank < plan.src.ranks and t.holds(rank)}
    dst = {t.name: empty_destination(t, rank=rank) for t in plan.dst.tensors if rank < plan.dst.ranks and t.holds(rank)}
    guards: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    if job.get("strided"):
        src = {name: _strided_copy(name, v, guards) for name, v in src.items()}
        dst = {name: _strided_copy(name, v, guards) for name, v in dst.items()}
    wrong = job.get("wrong_shape")  # test fault: one rank passes a tensor of another shape
    wrong_src = None
    if wrong and wrong["rank"] == rank and src:
        name = sorted(src)[0]
        wrong_src = {**src, name: src[name][:1] if isinstance(src[name], torch.Tensor) else src[name]}
    storage = {name: _data(v).data_ptr() for name, v in dst.items()}
    barriers = not any(job.get(f) for f in FAULTS)  # a collective would hang on a faulty rank
    stall_before = job.get("stall_before") or {}
    times, outcomes, store_keys, step_errors = [], [], [], []
    fills = {name: v.clone() for name, v in src.items()} if job.get("alternate") else {}
    succeeded = True
    for step in range(1, job.get("steps", 1) + 1):
        if stall_before.get("rank") == rank and stall_before.get("step", 1) == step:
            time.sleep(stall_before.get("seconds", 3600))
        if barriers:
            dist.barrier(group=group)
        given = wrong_src if wrong_src is not None and step >= wrong.get("step", 1) else src
        if job.get("alternate"):
            for name, v in src.items():
                v.copy_(fills[name]) if step % 2 else v.zero_()
        if step in job.get("release", ()):
            refitter.release_staging()
        outcome = _attempt(refitter, given, dst, RefitError)
        outcomes.append(outcome)
        if outcome["error"] and job.get("retry"):
            outcomes.append(_attempt(refitter, given, dst, RefitError))
        if outcomes[-1]["error"]:
            succeeded = False
            break
        if barriers:
            dist.barrier(group=group)
            if job.get("count_store_keys"):
                store_keys.append(dist.distributed_c10d._get_default_store().num_keys())
                # rank 0 hosts the store: nobody leaves the last step before every rank has read it
                dist.barrier(group=group)
        times.append(outcome["seconds"])
        if job.get("alternate") and not step_errors:
            step_errors += [f"step {step}: {e}" for e in _check_step(plan, rank, dst, step % 2 == 1)]
    errors = step_errors[:3]
    if succeeded:
        errors += [e for t in plan.dst.tensors if t.name in dst and t.holds(rank)
                  for e in [check_destination(t, rank, dst[t.name], plan)] if e]
        moved = [name for name, v in dst.items() if _data(v).data_ptr() != storage[name]]
        if moved:
            errors.append(f"destination storage was replaced, not updated in place: {moved[:3]}")
    errors += [f"`{name}`: an element outside the tensor's view was written" for name, buf, mask in guards
               if not bool((buf[mask].to(torch.float32) == _guard(buf.dtype)).all())]
    first_error = next((o["error"] for o in outcomes if o["error"]), None)
    n = max(len(times), 1)
    mode = getattr(refitter.transport, "mode", None)
    refitter.close()
    return {"seconds": times, "outcomes": outcomes, "error": first_error if not succeeded else None,
            "first_error": first_error, "reusable": refitter.reusable,
            "sent_bytes": refitter.sent_bytes // n, "received_bytes": refitter.received_bytes // n,
            "local_bytes": refitter.local_bytes // n, "staging_peak": refitter.meter.peak,
            "staging_held": refitter.staging_held, "staged_ahead": refitter.staged_ahead,
            "replayed": refitter.replayed, "transport_mode": mode,
            "checked_tensors": len(dst) if succeeded else 0, "check_errors": errors[:5], "store_keys": store_keys,
            "largest_tensor_bytes": max((_nbytes(v) for v in list(dst.values()) + list(src.values())), default=0)}


def _transport(job: dict, group):
    """The job's `transport` (a name, "group" by default), built with its `transport_options`."""
    from .transport import make_transport, transport_class

    name = job.get("transport", "group")
    options = job.get("transport_options")
    return transport_class(name)(group, **options) if options else make_transport(name, group)


def _check_step(plan, rank: int, dst: dict, filled: bool) -> list[str]:
    """`alternate`: after a step with filled sources every destination holds the layouts' values
    (layoutlang/runtime/fill.py); after one with zeroed sources every element is zero."""
    from .fill import check_destination

    held = [t for t in plan.dst.tensors if t.name in dst and t.holds(rank)]
    if filled:
        return [e for t in held for e in [check_destination(t, rank, dst[t.name], plan)] if e]
    return [f"`{t.name}` holds {int(dst[t.name].count_nonzero())} non-zero elements after a step of zero sources"
            for t in held if dst[t.name].count_nonzero()]


def _attempt(refitter, src, dst, error_type) -> dict:
    """One refit call: how long it took and, if it failed, what it said."""
    start = time.perf_counter()
    try:
        refitter.refit(src or None, dst or None)
    except error_type as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - start, "reusable": exc.reusable,
                "peers": list(exc.peers), "phase": exc.phase, "step": exc.step}
    return {"error": None, "seconds": time.perf_counter() - start}


def _data(v) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else v.data


def _nbytes(v) -> int:
    t = _data(v)
    return t.numel() * 2 if not isinstance(v, torch.Tensor) else t.numel() * t.element_size()


def _guard(dtype: torch.dtype) -> float:
    return GUARD.get(dtype, 1024.0)


def _strided_view(t: torch.Tensor, name: str, guards: list) -> torch.Tensor:
    """`t`'s values in every other element of the last dim of a bigger buffer; the rest are guards."""
    shape = tuple(t.shape) if t.dim() else (1,)
    big = torch.full(shape[:-1] + (2 * shape[-1] + 1,), _guard(t.dtype), dtype=torch.float32).to(t.dtype)
    view = big[..., 1::2]
    view.copy_(t.reshape(shape))
    mask = torch.ones(big.shape, dtype=torch.bool)
    mask[..., 1::2] = False
    guards.append((name, big, mask))
    return view if t.dim() else view.reshape(())


def _strided_copy(name: str, value, guards: list):
    """The same values, held by a non-contiguous view (quantized: data and scales both)."""
    if isinstance(value, torch.Tensor):
        return _strided_view(value, name, guards)
    fields = {f: _strided_view(getattr(value, f), f"{name}.{f}", guards) for f in ("data", "scale", "scales")
              if isinstance(getattr(value, f, None), torch.Tensor) and getattr(value, f).dim()}
    return type(value)(**{**value.__dict__, **fields})


class FaultHooks(RefitHooks):
    """The job's faults for this rank, injected through the runtime's documented hooks."""

    KINDS = ("die", "die_before", "stall", "corrupt")

    def __init__(self, job: dict, rank: int):
        mine = lambda f: job.get(f) if (job.get(f) or {}).get("rank") == rank else None  # noqa: E731
        self.die, self.die_before, self.stall, self.corrupt = mine("die"), mine("die_before"), mine("stall"), mine(
            "corrupt")

    @classmethod
    def any_for(cls, job: dict, rank: int) -> bool:
        """Does the job inject a fault through hooks on this rank?"""
        return any((job.get(f) or {}).get("rank") == rank for f in cls.KINDS)

    def before_refit(self, refitter, step: int) -> None:
        if self.die_before and self.die_before.get("step", 1) == step:
            time.sleep(self.die_before.get("after", 0))
            os._exit(3)

    def before_bucket(self, refitter, step: int, bucket: int) -> None:
        if self.die and self.die.get("bucket", 0) == bucket and self.die.get("step", 1) == step:
            time.sleep(self.die.get("after", 0))
            if self.die.get("kill"):  # SIGKILL: no exit code of its own, nothing run on the way out
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        if self.stall and self.stall.get("bucket", 0) == bucket and self.stall.get("step", 1) == step:
            time.sleep(self.stall.get("seconds", 3600))

    def on_send(self, buf: torch.Tensor, op) -> torch.Tensor:
        if self.corrupt and op.id == self.corrupt.get("op", op.id):
            buf = buf.clone()
            buf.reshape(-1)[0] += 1
        return buf


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
