"""The "auto" transport, `Refitter`'s default (layoutlang/runtime/transport_auto.py): shared
memory for the pairs of ranks on one host, the process group for every other pair.

One 4-process launch: ranks 2 and 3 pretend to run on another host (their boot id is
replaced in the program, as a second machine's would differ), so each rank has one peer on
"its host" and two elsewhere. The plan makes every rank exchange with every other (columns
over 4 ranks -> rows over 4 ranks), so every round mixes both kinds of message. Expected:
the whole tensor, cut by hand per rank; the pairs' transports from the hosts by hand."""

import pytest

from layoutlang.runtime.launch import launch
from layoutlang.runtime.transport import transport_class
from layoutlang.runtime.transport_auto import AutoTransport

SRC = "mesh s (tp=4)\ntensor w [16, 32 over tp]\n"   # rank r: columns 8r..8r+8
DST = "mesh d (tp=4)\ntensor w [16 over tp, 32]\n"   # rank r: rows 4r..4r+4

PROGRAM = """
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from layoutlang.compiler import compile_plan
from layoutlang.runtime import Refitter, memlinks

job = json.load(open(sys.argv[1]))
rank = int(os.environ["RANK"])
if rank >= 2:  # another host: another boot id
    memlinks._boot_id = lambda: "another-host-boot-id"
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
plan = compile_plan(job["src"], job["dst"])
out = {"ok": True, "exact": [], "transports": {}}
for steady in (False, True):
    refitter = Refitter(plan, timeout=30, steady=steady)   # the default transport: "auto"
    out["kind"] = type(refitter.transport).__name__
    src = {"w": torch.empty(16, 8, dtype=torch.bfloat16)}   # the same tensors every step, rewritten
    dst = {"w": torch.empty(4, 32, dtype=torch.bfloat16)}   # in place (a steady step replays)
    for step in range(1, 5):
        full = (torch.arange(16 * 32, dtype=torch.float32).reshape(16, 32) * step + 1000 * steady).to(torch.bfloat16)
        src["w"].copy_(full[:, 8 * rank:8 * rank + 8])
        dst["w"].fill_(float("nan"))
        refitter.refit(src, dst)
        out["exact"].append(torch.equal(dst["w"], full[4 * rank:4 * rank + 4]))
    out["transports"][str(steady)] = {str(k): v for k, v in refitter.transports.items()}
    out["replayed"] = refitter.replayed
    refitter.close()
json.dump(out, open(sys.argv[2], "w"))
dist.destroy_process_group()
"""


def test_auto_is_the_default_and_registered():
    assert transport_class("auto") is AutoTransport
    import inspect

    from layoutlang.runtime import Refitter
    assert inspect.signature(Refitter).parameters["transport"].default == "auto"


@pytest.mark.timeout(120)
def test_auto_moves_each_pair_by_its_host(tmp_path):
    (tmp_path / "src.layout").write_text(SRC)
    (tmp_path / "dst.layout").write_text(DST)
    (tmp_path / "prog.py").write_text(PROGRAM)
    job = {"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout")}
    results = launch(job, 4, timeout=100, program=str(tmp_path / "prog.py"))
    assert all(r.ok for r in results), "\n".join(f"rank {r.rank}: {r.error} {r.stderr[-1500:]}" for r in results)
    for r in results:
        out = r.result
        assert out["kind"] == "AutoTransport"
        assert out["exact"] == [True] * 8, (r.rank, out["exact"])
        host = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}[r.rank]
        want = {str(p): "memory (cma)" if p in host else "group (gloo)" for p in range(4) if p != r.rank}
        assert out["transports"] == {"False": want, "True": want}, (r.rank, out["transports"])
        assert out["replayed"] >= 2  # the steady Refitter's steps 3 and 4 replay step 2's record


def test_layoutc_run_takes_a_transport(capsys, tmp_path):
    """`layoutc run --transport NAME`: an unknown name is refused before any process starts,
    naming the known ones; a known one reaches every worker (2 processes, every element checked)."""
    from layoutlang.cli import main

    (tmp_path / "src.layout").write_text("mesh s (tp=2)\ntensor w [8, 16 over tp]\n")
    (tmp_path / "dst.layout").write_text("mesh d (tp=2)\ntensor w [8 over tp, 16]\n")
    argv = ["run", str(tmp_path / "src.layout"), str(tmp_path / "dst.layout"), "--nproc", "2"]
    assert main([*argv, "--transport", "pigeon"]) == 2
    err = capsys.readouterr().err
    assert 'error: unknown transport \'pigeon\': known are "auto", "group", "memory", "nixl"' in err
    assert main([*argv, "--transport", "memory", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "with process start-up; transport memory (cma)\n" in out and "checked: ok" in out
