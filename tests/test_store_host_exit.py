"""The store's host may leave as soon as its refit returns (issue 26, one world).

Under env:// initialization rank 0's process hosts the process group's store. In
50 of 50 fresh 3-rank worlds, rank 0 refits and leaves AT ONCE (`os._exit`: no
barrier, no `destroy_process_group`), and every other rank's refit still
succeeds with every destination element exact (computed here from the layouts'
shapes, independently of the runtime's fill). The rounds cycle through plans in
which rank 0 is the last to arrive at the fence (it only receives), the first
(it only sends) and neither (every rank sends and receives), each as one step, one
`verify=True` step, three `steady=True` steps (the last replayed: it makes no
store request), and one step that every rank's agreement refuses (rank 1's tensor has
the wrong shape: rank 0 leaves right after its own RefitError, the others must still
say why, not "store unreachable").

Run as a program, this file is one rank over every round (`python THIS RANK ROUNDS DIR`):
a persistent parent that imported torch once forks a child per round, so a round costs
a fork, not a Python start. Rank 0's child hosts a fresh store (port 0: the OS picks,
written to DIR/<round>/port) and joins a fresh gloo group on it; the others connect to
it. Each peer child writes what its refit said to DIR/<round>/rank-<R>.json. Nothing
is pickled: ports and results are files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

WORLD = 3
ROUNDS = 50
TIMEOUT = timedelta(seconds=10)   # the Refitter's: a round that fails says so within it
ROWS = "mesh a (tp=3)\ntensor w [6 over tp, 6] fp32\n"
COLS = "mesh c (tp=3)\ntensor w [6, 6 over tp] fp32\n"
WHOLE = "mesh b (tp=1) at 0\ntensor w [6, 6] fp32\n"
PLANS = {"gather": (ROWS, WHOLE), "scatter": (WHOLE, ROWS), "transpose": (ROWS, COLS)}
# "refused": rank 1 passes a truncated tensor, so every rank's step fails its agreement
# (reusable, nothing moved): rank 0 leaves at once after its own RefitError
MODES = {"plain": {}, "verify": {"verify": True}, "steady": {"steady": True}, "refused": {}}


def case(k: int) -> tuple[str, str]:
    """Round k's plan and mode (every pair comes up at least four times in 50 rounds)."""
    return list(PLANS)[k % 3], list(MODES)[(k // 3) % 4]


def block(layout: str, rank: int, step: int):
    """Rank `rank`'s local block of w in `layout` at `step` (None where it holds none): the
    logical w is 100 * step + its flat index, exact in fp32."""
    import torch

    w = torch.arange(36, dtype=torch.float32).reshape(6, 6) + 100 * step
    if layout == WHOLE:
        return w.clone() if rank == 0 else None
    return (w[2 * rank:2 * rank + 2] if layout == ROWS else w[:, 2 * rank:2 * rank + 2]).clone()


# ---- the program: one rank over every round --------------------------------------------
def _die_with_parent() -> None:
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)  # readers see the whole file or none


def _port(at: Path, within: float = 20.0) -> int:
    deadline = time.monotonic() + within
    while not (at / "port").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no store port in {at}")
        time.sleep(0.002)
    return int((at / "port").read_text())


def one_round(rank: int, k: int, at: Path, plans: dict) -> None:
    import torch.distributed as dist
    from layoutlang.runtime import RefitError, Refitter

    name, mode = case(k)
    src_text, dst_text = PLANS[name]
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, WORLD, True, TIMEOUT, wait_for_workers=False)
        _write(at / "port", str(store.port))
    else:
        store = dist.TCPStore("127.0.0.1", _port(at), WORLD, False, TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    refitter = Refitter(plans[name], timeout=TIMEOUT, **MODES[mode])
    dst = block(dst_text, rank, 0)
    dst = {"w": dst.fill_(float("nan"))} if dst is not None else None
    src = {"w": block(src_text, rank, 1)} if block(src_text, rank, 1) is not None else None
    if mode == "refused" and rank == 1:
        src, dst = ({"w": side["w"][:1]} if side is not None else None for side in (src, dst))
    steps = 3 if mode == "steady" else 1
    try:
        for step in range(1, steps + 1):
            if src is not None and mode != "refused":
                src["w"].copy_(block(src_text, rank, step))  # in place: the steady steps replay
            refitter.refit(src, dst)
    except RefitError as exc:
        if mode == "refused" and exc.reusable and "rank 1: " in exc.detail and "nothing was moved" in exc.detail:
            if rank == 0:
                os._exit(0)  # at once, after its own failed refit
            _write(at / f"rank-{rank}.json", json.dumps({"refused": True}))
            os._exit(0)
        _write(at / f"rank-{rank}.json", json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        os._exit(1)
    if rank == 0:
        os._exit(0)  # at once: the store goes with this process
    want = block(dst_text, rank, steps)
    exact = want is None or bool((dst["w"] == want).all())
    _write(at / f"rank-{rank}.json", json.dumps({"exact": exact, "replayed": refitter.replayed}))
    os._exit(0)


def main() -> int:
    rank, rounds, where = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    _die_with_parent()
    from layoutlang import compile_plan, loads
    from layoutlang.compiler.steps import schedule
    import layoutlang.runtime  # noqa: F401 - torch and the runtime imported once, before the forks

    plans = {name: compile_plan(loads(src), loads(dst)) for name, (src, dst) in PLANS.items()}
    for plan in plans.values():
        schedule(plan, rank, None, False)  # (what a Refitter imports and computes first)
    for k in range(rounds):
        at = where / str(k)
        at.mkdir(parents=True, exist_ok=True)
        pid = os.fork()
        if pid == 0:
            _die_with_parent()
            try:
                one_round(rank, k, at, plans)
            except BaseException as exc:  # noqa: BLE001 - the child reports and leaves, never returns
                _write(at / f"crash-{rank}.json", json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            os._exit(1)
        deadline = time.monotonic() + 3 * TIMEOUT.total_seconds()
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                _write(at / f"crash-{rank}.json", json.dumps({"error": "killed at the round's deadline"}))
                break
            time.sleep(0.002)
    return 0


# ---- the test ---------------------------------------------------------------------------
def run_rounds(where: Path, rounds: int = ROUNDS) -> list:
    """Every rank over `rounds` rounds; the rounds that failed, with what each peer said."""
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(rounds), str(where)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
             for rank in range(WORLD)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=100)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    failed = []
    for k in range(rounds):
        at = where / str(k)
        said = {path.name: json.loads(path.read_text()) for path in sorted(at.glob("*.json"))}
        name, mode = case(k)
        said_ok = {"refused": True} if mode == "refused" else {"exact": True, "replayed": 1 if mode == "steady" else 0}
        want = {f"rank-{r}.json": said_ok for r in range(1, WORLD)}
        if said != want:
            failed.append((k, name, mode, said))
    return failed


@pytest.mark.timeout(120)
def test_rank_0_leaves_right_after_its_refit_and_every_peer_still_succeeds(tmp_path):
    failed = run_rounds(tmp_path)
    assert not failed, f"{len(failed)} of {ROUNDS} rounds failed: {failed[:3]}"


if __name__ == "__main__":
    sys.exit(main())
