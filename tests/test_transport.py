"""A transport is one class and a registry entry (layoutlang/runtime/transport.py).

A recording wrapper around the "group" transport, registered under a test name, runs a
two-process refit: every message of the plan goes through it (one per remote op end, as the
plan lists them) and the destination is exact (the full tensor, cut by hand)."""

import pytest

from layoutlang.compiler import compile_plan
from layoutlang.diagnostics import UsageError
from layoutlang.runtime.launch import launch
from layoutlang.runtime.transport import TRANSPORTS, Transport, transport_class
from layoutlang.runtime.transport_group import GroupTransport

SRC = "mesh s (tp=2)\ntensor w [8, 16 over tp]\n"   # rank r: columns 8r..8r+8
DST = "mesh d (tp=2)\ntensor w [8 over tp, 16]\n"   # rank r: rows 4r..4r+4
STEPS = 2

PROGRAM = """
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from layoutlang.compiler import compile_plan
from layoutlang.runtime import Refitter
from layoutlang.runtime.transport import register
from layoutlang.runtime.transport_group import GroupTransport

job = json.load(open(sys.argv[1]))
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
posted = {"send": 0, "recv": 0, "bytes": 0, "waited": 0}


class Recording(GroupTransport):
    def post(self, messages, what, calls=None):
        for m in messages:
            posted["send" if m.op is dist.isend else "recv"] += 1
            posted["bytes"] += m.tensor.numel() * m.tensor.element_size() if m.op is dist.isend else 0
        return super().post(messages, what, calls)

    def wait(self, works, ops, what, deadline=None):
        posted["waited"] += len(works)
        return super().wait(works, ops, what, deadline)


register("test-recording", Recording)
refitter = Refitter(compile_plan(job["src"], job["dst"]), transport="test-recording", timeout=30)
full = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16).to(torch.bfloat16)
exact = []
for step in range(1, job["steps"] + 1):
    value = full * step
    src = {"w": value[:, 8 * rank:8 * rank + 8].contiguous()}
    dst = {"w": torch.zeros(4, 16, dtype=torch.bfloat16)}
    refitter.refit(src, dst)
    exact.append(torch.equal(dst["w"], value[4 * rank:4 * rank + 4]))
out = {"ok": True, "kind": type(refitter.transport).__name__, "exact": exact, "sent_bytes": refitter.sent_bytes}
json.dump({**out, **posted}, open(sys.argv[2], "w"))
dist.destroy_process_group()
"""


def test_the_registry_names_what_exists():
    assert transport_class("group") is GroupTransport
    with pytest.raises(UsageError) as err:
        transport_class("pigeon")
    first, help_ = str(err.value).splitlines()
    known = sorted(TRANSPORTS)
    assert first == "error: unknown transport 'pigeon': known are " + ", ".join(f'"{n}"' for n in sorted(known))
    assert {"auto", "group", "memory", "nixl"} <= set(known)
    assert help_.endswith("register a transport of your own with layoutlang.runtime.transport.register(name, cls)")
    assert all(isinstance(v, str) for v in TRANSPORTS.values())  # import paths: loaded when chosen
    assert issubclass(GroupTransport, Transport)


@pytest.mark.timeout(120)
def test_a_registered_transport_carries_every_message_of_a_refit(tmp_path):
    (tmp_path / "src.layout").write_text(SRC)
    (tmp_path / "dst.layout").write_text(DST)
    (tmp_path / "prog.py").write_text(PROGRAM)
    plan = compile_plan(str(tmp_path / "src.layout"), str(tmp_path / "dst.layout"))
    job = {"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "steps": STEPS}
    results = launch(job, 2, timeout=100, program=str(tmp_path / "prog.py"))
    assert all(r.ok for r in results), "\n".join(f"rank {r.rank}: {r.error} {r.stderr[-800:]}" for r in results)
    for r in results:
        out = r.result
        remote = [op for op in plan.ops if op.src_rank != op.dst_rank]
        sends = [op for op in remote if op.src_rank == r.rank]
        recvs = [op for op in remote if op.dst_rank == r.rank]
        # the plan by hand: rank r sends rows 4(1-r).. of its 8 columns, 4 x 8 bf16 = 64 B
        assert len(sends) == len(recvs) == 1 and sends[0].bytes == 4 * 8 * 2
        assert out["kind"] == "Recording" and out["exact"] == [True] * STEPS
        assert (out["send"], out["recv"]) == (STEPS * len(sends), STEPS * len(recvs))
        assert out["waited"] == out["send"] + out["recv"]
        assert out["bytes"] == out["sent_bytes"] == STEPS * sum(op.bytes for op in sends)
