"""Steady steps replayed from a record (layoutlang/runtime/replay.py) move the right bytes, every step.

A replay that moved nothing would pass a check of the last step's destination (step 2 filled
it), so these workers (`alternate`) write their sources in place every step, the layouts'
fill in odd steps and zeros in even ones, and check every destination element after every
step: the fill (layoutlang/runtime/fill.py, from the layouts) after odd steps, zeros after even ones.
Each rank reports how many steps it replayed: step 1 meets, step 2 is walked and recorded,
and every later step must replay (a test whose steps were all walked would test nothing).
"""

import subprocess
import sys

import pytest

from layoutlang.compiler import compile_plan
from layoutlang.compiler.graph import buckets
from layoutlang.compiler.steps import schedule
from layoutlang.runtime.launch import launch
from layoutlang.runtime.replay import replayable, stages

from test_relay import TRAIN  # a two-rank bf16 trainer: a padded embedding, fused gate|up
import steady_inplace_program

STEPS = 5

TP4 = """
mesh s (tp=4)
tensor a [64 over tp, 48]
tensor b [48, 64 over tp]
tensor c [40 over tp]
tensor d [32 over tp, 32]
"""

TP2 = """
mesh d (tp=2)
tensor a [64, 48 over tp]
tensor b [48 over tp, 64] fp32
tensor c [40]
tensor d [32, 32 over tp]
"""

# six single-rank bf16 replicas of TRAIN on ranks 0-5: relays, padding, an fp32 norm
REPLICAS = """
mesh infer (dp=6)
tensor embed as emb [100 pad 64, 32]
tensor norm [32] fp32
for l in 0..2 {
  tensor l{l}.gate_up as layers.{l}.fc1 [(gate: 32 | up: 32), 32]
  tensor l{l}.down as layers.{l}.fc2 [32, 32]
}
"""

CASES = {
    # a block-strided GTP source copied locally and sent, a transposed key in blocks, stacked
    # experts, padding, relays (tests/test_steady_inplace.py checks these against the reference)
    "blocked-turned": (steady_inplace_program.TRAIN, steady_inplace_program.ENGINE, {}),
    "staged-receives": (TP4, TP2, {}),
    "strided-views": (TP4, TP2, {"strided": True}),            # every send and receive staged
    "overlap-buckets": (TP4, TP2, {"overlap": True, "budget": 2048}),  # staged ahead, two arenas
    "relays-padding": (TRAIN, REPLICAS, {}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_replayed_steps_are_exact_every_step(tmp_path, case):
    src_text, dst_text, extra = CASES[case]
    (tmp_path / "src.layout").write_text(src_text)
    (tmp_path / "dst.layout").write_text(dst_text)
    src, dst = str(tmp_path / "src.layout"), str(tmp_path / "dst.layout")
    plan = compile_plan(src, dst)
    if case == "relays-padding":
        assert any(op.after for op in plan.ops)  # relays
        assert any(st.kind == "zero" for r in range(plan.world) for steps in schedule(plan, r, None).steps
                   for st in steps)  # padding zeroed every step
    if case == "overlap-buckets":
        assert len(buckets(plan, extra["budget"] // 2)) >= 3
    results = launch({"src": src, "dst": dst, "steady": True, "alternate": True, "steps": STEPS, **extra},
                     plan.world, timeout=240)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')} {r.stderr[-600:]}"
        assert r.result["check_errors"] == []
        held = sum(1 for t in plan.dst.tensors if r.rank < plan.dst.ranks and t.holds(r.rank))
        assert r.result["checked_tensors"] == held
        assert r.result["replayed"] == STEPS - 2, r.result
    if case == "overlap-buckets":
        assert sum(r.result["staged_ahead"] for r in results) > 0


# TP4 -> TP2 on ranks 0-1. `a` (rows): every source shard is sent whole and lands as a
# whole block of rows. `b` (columns): each source shard [48, 16] is sent whole too, but
# lands as a column block of the receiver's [48, 32]: not contiguous, so it is received
# into a buffer. Rank 0 copies its own shard of `b` and receives rank 1's (staged); rank 1
# receives ranks 2's and 3's (staged); ranks 2 and 3 only send whole shards.
ROWS_AND_COLUMNS = ("mesh s (tp=4)\ntensor a [64 over tp, 48]\ntensor b [48, 64 over tp]\n",
                    "mesh d (tp=2)\ntensor a [64 over tp, 48]\ntensor b [48, 64 over tp]\n")


@pytest.mark.timeout(300)
def test_ranks_that_stage_nothing_replay_without_kept_staging(tmp_path):
    """A record of a rank that stages nothing holds only views of the caller's tensors, so it
    replays without kept arenas (`keep_staging=False`, an accelerator's default); a rank that
    stages walks every step there. Which ranks stage is read off the layouts above."""
    (tmp_path / "src.layout").write_text(ROWS_AND_COLUMNS[0])
    (tmp_path / "dst.layout").write_text(ROWS_AND_COLUMNS[1])
    src, dst = str(tmp_path / "src.layout"), str(tmp_path / "dst.layout")
    results = launch({"src": src, "dst": dst, "steady": True, "alternate": True, "steps": STEPS,
                      "keep_staging": False}, 4, timeout=240)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')} {r.stderr[-600:]}"
        assert r.result["check_errors"] == []
        assert r.result["checked_tensors"] == (2 if r.rank < 2 else 0)
        assert r.result["staging_held"] == 0
    assert [r.result["replayed"] for r in results] == [0, 0, STEPS - 2, STEPS - 2]
    # Staging kept: every rank replays step 3. `release_staging()` before step 4 drops every
    # record and the arenas: step 4 is walked everywhere; ranks 2 and 3 record it (it holds no
    # buffer) and replay step 5; ranks 0 and 1 have no arena to record into until step 4 made
    # one, so they record step 5 instead.
    kept = launch({"src": src, "dst": dst, "steady": True, "alternate": True, "steps": STEPS, "release": [4]},
                  4, timeout=240)
    assert all(r.ok and r.result["check_errors"] == [] for r in kept), [r.error for r in kept]
    assert [r.result["replayed"] for r in kept] == [1, 1, 2, 2]


def test_which_ranks_stage_is_read_off_the_layouts(tmp_path):
    """The pair above: ranks 0 and 1 receive `b`'s column blocks through buffers; ranks 2 and 3
    send whole shards; with `strided` (a caller's tensor may be a view) every transfer stages."""
    (tmp_path / "src.layout").write_text(ROWS_AND_COLUMNS[0])
    (tmp_path / "dst.layout").write_text(ROWS_AND_COLUMNS[1])
    plan = compile_plan(str(tmp_path / "src.layout"), str(tmp_path / "dst.layout"))
    assert [stages(schedule(plan, r, None)) for r in range(4)] == [True, True, False, False]
    assert [stages(schedule(plan, r, None, strided=True)) for r in range(4)] == [True] * 4


def test_only_plain_steps_are_replayed(tmp_path):
    """Quantizing and dequantizing allocate per step and depend on values: a rank with such a step
    walks every step. An mxfp8 `l{l}.gate_up` gives every replica (ranks 0-5, the trainer's two
    among them) an assembly quantized once per step; the same replicas in bf16 replay."""
    (tmp_path / "src.layout").write_text(TRAIN)
    (tmp_path / "dst.layout").write_text(REPLICAS.replace("(gate: 32 | up: 32), 32]", "(gate: 32 | up: 32), 32] mxfp8"))
    plan = compile_plan(str(tmp_path / "src.layout"), str(tmp_path / "dst.layout"), wire="bf16")
    assert [replayable(schedule(plan, r, None)) for r in range(plan.world)] == [False] * 6
    (tmp_path / "plain.layout").write_text(REPLICAS)
    plain = compile_plan(str(tmp_path / "src.layout"), str(tmp_path / "plain.layout"))
    assert [replayable(schedule(plain, r, None)) for r in range(plain.world)] == [True] * 6


def _one_process(tmp_path, program: str, src_text: str, dst_text: str) -> list[str]:
    """Run `program` (one gloo process) on the two layouts; its stdout lines."""
    (tmp_path / "src.layout").write_text(src_text)
    (tmp_path / "dst.layout").write_text(dst_text)
    (tmp_path / "prog.py").write_text(program)
    proc = subprocess.run([sys.executable, str(tmp_path / "prog.py"), str(tmp_path / "src.layout"),
                           str(tmp_path / "dst.layout")], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


NEW_TENSORS = """
import socket, sys
import torch, torch.distributed as dist
from layoutlang.compiler import compile_plan
from layoutlang.runtime import Refitter
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
plan = compile_plan(sys.argv[1], sys.argv[2])
refitter = Refitter(plan, steady=True, timeout=5)
src = {"w": torch.zeros(8, 6, dtype=torch.bfloat16)}
dst = {"w": torch.zeros(6, 8, dtype=torch.bfloat16)}
other = {"w": torch.zeros(6, 8, dtype=torch.bfloat16)}
g = torch.Generator().manual_seed(0)
for step, given in enumerate([dst, dst, dst, other, other, other, "release", other], start=1):
    if given == "release":
        refitter.release_staging()
        given = other
    src["w"].copy_(torch.randn(8, 6, generator=g).to(torch.bfloat16))
    refitter.refit(src, given)
    # w is stored transposed in the destination: [6, 8] holds w.T
    print(step, refitter.replayed, torch.equal(given["w"], src["w"].t()))
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_other_tensors_are_walked_and_recorded_again(tmp_path):
    """One gloo process (every op a local copy of a transposed key). Step 1 meets, step 2 records,
    step 3 replays; step 4 gets another destination tensor: walked; step 5, the same one again:
    recorded; step 6 replays; `release_staging()` drops the record: step 7 is walked, and
    recorded (its tensors are step 6's, and a local copy stages nothing, so no arena is needed);
    step 8 replays. Every step is exact."""
    out = _one_process(tmp_path, NEW_TENSORS, "mesh s (r=1)\ntensor w [8, 6]\n",
                       "mesh d (r=1)\ntensor w [6, 8] transposed\n")
    assert " ".join(out).split() == "1 0 True 2 0 True 3 1 True 4 1 True 5 1 True 6 2 True 7 2 True 8 3 True".split()


POSTS = """
import socket, sys
import torch, torch.distributed as dist
from layoutlang.compiler import compile_plan
from layoutlang.runtime import Refitter
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
refitter = Refitter(compile_plan(sys.argv[1], sys.argv[2]), timeout=5)
cpu = torch.device("cpu")
print("gloo coalesces", refitter.transport.coalesces(cpu))
batches = []
dist.batch_isend_irecv = lambda ops: batches.append(len(ops)) or ["work"] * len(ops)
refitter.transport.coalescing[cpu] = True  # as NCCL's backend says
print(refitter.transport.post([dist.P2POp(dist.isend, torch.zeros(2), 0), dist.P2POp(dist.irecv, torch.zeros(2), 0)], "x"),
      batches)
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_messages_are_grouped_where_the_backend_groups_them(tmp_path):
    """NCCL needs a round's messages in one group (deadlock-free whatever order peers post in):
    `batch_isend_irecv`. Gloo cannot coalesce, and there each message is posted at once (what
    `batch_isend_irecv` does on gloo, less its checks). One gloo process: the backend's answer,
    and a backend that says it coalesces gets one batch of both messages."""
    out = _one_process(tmp_path, POSTS, "mesh s (r=1)\ntensor w [8, 4]\n", "mesh d (r=1)\ntensor w [8, 4]\n")
    assert out == ["gloo coalesces False", "['work', 'work'] [2]"]


@pytest.mark.timeout(180)
def test_replayed_posts_reach_their_peers_in_sub_groups(tmp_path):
    """A replay posts through the process group's own calls with the peer's rank in the group
    (layoutlang/runtime/replay.py `resolved_posts`). Two sub-groups run one plan at once: in [3, 1] torch
    orders the ranks (global 1 is group rank 0, global 3 group rank 1), and in [0, 2, 4]
    global 2 is group rank 1, so a global rank passed where a group rank belongs fails there
    or reaches the idle rank 4. `w` lands in column blocks (staged), `n` is copied whole."""
    (tmp_path / "src.layout").write_text("mesh s (tp=2)\ntensor w [48 over tp, 8]\ntensor n [6]\n")
    (tmp_path / "dst.layout").write_text("mesh d (tp=2)\ntensor w [48, 8 over tp]\ntensor n [6]\n")
    results = launch({"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "steady": True,
                      "alternate": True, "steps": STEPS, "groups": [[3, 1], [0, 2, 4]]}, 6, timeout=150)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')} {r.stderr[-600:]}"
        assert r.result["check_errors"] == []
    assert results[5].result["outside_group"] is True
    assert {r.rank: r.result["checked_tensors"] for r in results if r.rank != 5} == {0: 2, 1: 2, 2: 2, 3: 2, 4: 0}
    assert [r.result["replayed"] for r in results[:4]] == [STEPS - 2] * 4


RESOLVED = """
import socket, sys
import torch, torch.distributed as dist
from layoutlang.runtime.replay import resolved_posts
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
pg = dist.distributed_c10d._get_default_group()

class Seen(torch.Tensor):  # a subclass whose __torch_function__ would see dist.isend
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})

t, u = torch.zeros(2), torch.zeros(3)
calls = resolved_posts([dist.P2POp(dist.isend, t, 0), dist.P2POp(dist.irecv, u, 0, tag=7)], False)
print(calls[0][0] == pg.send, calls[1][0] == pg.recv, calls[0][1][0] is t, calls[1][1][0] is u,
      calls[0][2], calls[1][2], calls[0][3], calls[1][3])
print(resolved_posts([dist.P2POp(dist.isend, t, 0)], True))
print(resolved_posts([dist.P2POp(dist.isend, t, 0), dist.P2POp(dist.isend, torch.zeros(2, dtype=torch.complex64), 0)],
                     False))
print(resolved_posts([dist.P2POp(dist.isend, torch.zeros(2).as_subclass(Seen), 0)], False))
print(len(resolved_posts([dist.P2POp(dist.isend, torch.nn.Parameter(torch.zeros(2)), 0)], False)))
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_posts_resolve_to_the_process_groups_own_calls(tmp_path):
    """On gloo a record keeps, per message, the call `dist.isend` / `dist.irecv` would make: the
    group's send or recv, the tensor itself, the peer's group rank (the default group's are
    global ranks), the tag. A backend that groups messages, a complex tensor and a tensor with
    a `__torch_function__` keep the wrappers (None: the whole round goes through `_post`); a
    Parameter has no `__torch_function__` of its own and resolves."""
    out = _one_process(tmp_path, RESOLVED, "mesh s (r=1)\ntensor w [8, 4]\n", "mesh d (r=1)\ntensor w [8, 4]\n")
    assert out == ["True True True True 0 0 0 7", "None", "None", "None", "1"]


COUNTED = """
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

calls = {"isend": 0, "irecv": 0}


def counted(name, original):
    def call(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)
    return call


# every name `dist.isend` / `dist.irecv` is reached by (P2POp checks its op against c10d's)
for name in ("isend", "irecv"):
    wrapped = counted(name, getattr(c10d, name))
    setattr(c10d, name, wrapped)
    setattr(dist, name, wrapped)

from layoutlang.compiler import compile_plan
from layoutlang.runtime import Refitter

job = json.load(open(sys.argv[1]))
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
refitter = Refitter(compile_plan(job["src"], job["dst"]), steady=True, timeout=timedelta(seconds=30),
                    transport="group")  # (the process group's calls are what this counts)
full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4).to(torch.bfloat16)
src = {"w": torch.empty(4, 4, dtype=torch.bfloat16)}
dst = {"w": torch.zeros(8, 4, dtype=torch.bfloat16)} if rank == 0 else None
out = {"ok": False, "per_step": [], "exact": []}
for step in range(1, job["steps"] + 1):
    value = full * step  # new values every step: a step that moved nothing would show
    src["w"].copy_(value[4 * rank:4 * rank + 4])
    before = dict(calls)
    refitter.refit(src, dst)
    out["per_step"].append([calls[k] - before[k] for k in ("isend", "irecv")])
    if rank == 0:
        out["exact"].append(torch.equal(dst["w"], value))
out["replayed"] = refitter.replayed
out["ok"] = True
json.dump(out, open(sys.argv[2], "w"))
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_replayed_gloo_step_posts_without_the_wrappers(tmp_path):
    """TP2 -> one rank: rank 1 sends its half of `w` to rank 0, which copies its own half. With
    `dist.isend` / `dist.irecv` counted: step 1 (it meets) and step 2 (walked and recorded) post
    through them, one message each; steps 3-5 replay through the recorded process-group calls
    and post none through them, and rank 0's destination is exact after every step."""
    from layoutlang.runtime.launch import free_port
    (tmp_path / "src.layout").write_text("mesh s (tp=2)\ntensor w [8 over tp, 4]\n")
    (tmp_path / "dst.layout").write_text("mesh d (r=1)\ntensor w [8, 4]\n")
    (tmp_path / "prog.py").write_text(COUNTED)
    job = {"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "steps": STEPS,
           "port": free_port()}
    results = launch(job, 2, timeout=100, program=str(tmp_path / "prog.py"))
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.stderr[-800:]}"
    assert results[0].result["exact"] == [True] * STEPS
    # [isend, irecv] per step
    assert results[0].result["per_step"] == [[0, 1], [0, 1], [0, 0], [0, 0], [0, 0]]
    assert results[1].result["per_step"] == [[1, 0], [1, 0], [0, 0], [0, 0], [0, 0]]
    assert [r.result["replayed"] for r in results] == [STEPS - 2] * 2
