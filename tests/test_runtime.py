"""Multi-process refits on gloo: real processes on 127.0.0.1, hard timeouts, cleanup.

Each test launches local workers (`layoutlang.runtime.launch`): every worker
compiles the same plan, fills its source tensors from logical coordinates,
refits, and checks every destination element (padding zero, quantized
tensors equal to quantizing the reference, storage updated in place). The
fault-free 8-rank cases share one launch (`shared`, tests/shared_launch.py):
the same workers run each case's job in turn, as a launch of it alone would.
"""

import re
import subprocess
import sys
from math import prod

import pytest

from layoutlang.elaborate import load
from layoutlang.ir import QUANTIZED
from layoutlang.modes import Run
from layoutlang.compiler import compile_plan
from layoutlang.runtime.launch import launch
from shared_launch import SharedLaunches
from wire_rule import op_wire, slice_elements


TRAIN = """
mesh train (dp=2, gtp=2, tp=2)
tensor emb [100 pad 8 over tp, 32]
tensor norm [32]
for l in 0..2 {
  tensor layers.{l}.qkv [(2, (q: 2*4 | k: 4 | v: 4)) over tp chunk gtp align 4, 32]
  tensor layers.{l}.fc1 [(gate: 32 | up: 32) over tp chunk gtp, 32]
  tensor layers.{l}.fc2 [32 chunk gtp, 32 over tp]
}
"""

INFER = """
arg AT = 0
mesh infer (tp=2) at AT
tensor embed as emb [100 pad 64 over tp, 32]
tensor norm [32] fp32
for l in 0..2 {
  tensor l{l}.qkv_proj as layers.{l}.qkv [(q: (4, 4) | k: (2, 4) | v: (2, 4)) over tp, 32] mxfp8
  tensor l{l}.gate_up as layers.{l}.fc1 [(gate: 32 | up: 32) over tp, 32] fp8_e4m3
  tensor l{l}.down as layers.{l}.fc2 [32, 32 over tp] fp16
}
"""


@pytest.fixture
def pair(tmp_path):
    (tmp_path / "train.layout").write_text(TRAIN)
    (tmp_path / "infer.layout").write_text(INFER)
    return str(tmp_path / "train.layout"), str(tmp_path / "infer.layout")


IDLE_SRC = ("mesh s (dp=2, tp=2)\ntensor w [64 over tp, 32] fp8_e4m3\ntensor b [64, 64 over tp] mxfp8\n"
            "tensor n [8] fp32")
IDLE_DST = "mesh d (tp=2) at 5\ntensor w [64, 32 over tp]\ntensor b [64 over tp, 64] bf16\ntensor n [8] bf16"

# test item -> the shared cases it reads
SHARED_ITEMS = {
    "test_collocated_quantized_padded_gtp_with_buckets_and_verify": ("collocated",),
    "test_non_collocated_with_idle_ranks_and_quantized_source": ("idle",),
    "test_strided_views_of_bigger_buffers_are_written_in_place_and_nothing_else": ("strided",),
    "test_overlapped_buckets_are_exact_and_within_the_budget[buckets]": ("overlap-buckets",),
    "test_overlapped_buckets_are_exact_and_within_the_budget[one-bucket]": ("overlap-one-bucket",),
    "test_kept_staging_is_reused_exactly_and_stays_within_the_budget[sequential]": ("kept-False", "fresh-False"),
    "test_kept_staging_is_reused_exactly_and_stays_within_the_budget[overlap]": ("kept-True", "fresh-True"),
}


@pytest.fixture(scope="module")
def shared(request, tmp_path_factory) -> SharedLaunches:
    """The fault-free 8-rank cases in one launch (those this session selected)."""
    d = tmp_path_factory.mktemp("shared")
    for name, text in (("train", TRAIN), ("infer", INFER), ("idle_src", IDLE_SRC), ("idle_dst", IDLE_DST)):
        (d / f"{name}.layout").write_text(text)
    pair = {"src": str(d / "train.layout"), "dst": str(d / "infer.layout")}
    cases = [("collocated", {**pair, "verify": True, "budget": 1024, "steps": 3}),
             ("idle", {"src": str(d / "idle_src.layout"), "dst": str(d / "idle_dst.layout"), "verify": True}),
             ("strided", {**pair, "verify": True, "budget": 1024, "strided": True}),
             ("overlap-buckets", {**pair, "budget": 1024, "steps": 3, "overlap": True}),
             ("overlap-one-bucket", {**pair, "budget": None, "steps": 3, "overlap": True})]
    for overlap in (False, True):
        cases += [(f"kept-{overlap}", {**pair, "budget": 1024, "steps": 3, "overlap": overlap}),
                  (f"fresh-{overlap}", {**pair, "budget": 1024, "steps": 3, "overlap": overlap,
                                        "keep_staging": False})]
    selected = {c for item in request.session.items for c in SHARED_ITEMS.get(item.name, ())}
    shared = SharedLaunches({"8": (8, cases)}, selected, timeout_per_case=60, alone_timeout=150)
    shared.pair = (pair["src"], pair["dst"])
    return shared


def _assert_all_ok(results):
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')}"


def _destination_bytes(src: str, dst: str, wire: str = "auto") -> int:
    """Every data (non-padding) element of every destination instance, once (counted from the
    layout), in the bytes the wire rule gives each op (tests/wire_rule.py)."""
    layout = load(dst)
    data = sum(prod(sum(r.length for r in runs if isinstance(r, Run)) for runs in t.runs(rank))
               for t in layout.tensors for rank in range(layout.ranks) if t.holds(rank))
    plan = compile_plan(src, dst, wire=wire)
    assert sum(slice_elements(op.dst_slice) for op in plan.ops) == data
    held = {t.name: t for t in layout.tensors}
    rule = [op_wire(op.dst_slice, held[op.dst_name].dtype, tuple(held[op.dst_name].local_shape_at(op.dst_rank)), wire)
            for op in plan.ops]
    assert [op.wire is not None for op in plan.ops] == [packed for packed, _ in rule]
    return sum(n for _, n in rule)


@pytest.mark.timeout(600)  # the first shared case waits for the whole shared launch
def test_collocated_quantized_padded_gtp_with_buckets_and_verify(shared):
    src, dst = shared.pair
    budget = 1024  # several buckets, also with the quantized wire (4096: one)
    results = shared.results_for("collocated")
    _assert_all_ok(results)
    received = sum(r.result["received_bytes"] + r.result["local_bytes"] for r in results)
    assert received == _destination_bytes(src, dst)  # every destination element arrived exactly once per step
    for r in results:  # staging stays under the budget plus the largest tensor
        assert r.result["staging_peak"] <= budget + r.result["largest_tensor_bytes"]


@pytest.mark.timeout(600)  # the first shared case waits for the whole shared launch
def test_non_collocated_with_idle_ranks_and_quantized_source(shared):
    results = shared.results_for("idle")  # IDLE_SRC -> IDLE_DST on 8 ranks: ranks 4 and 7 hold nothing
    _assert_all_ok(results)
    for idle in (4, 7):
        res = results[idle].result
        assert res["sent_bytes"] == res["received_bytes"] == res["local_bytes"] == res["checked_tensors"] == 0
    assert sum(r.result["checked_tensors"] for r in results) == 6  # w, b, n on ranks 5 and 6


@pytest.mark.timeout(600)  # the first shared case waits for the whole shared launch
def test_strided_views_of_bigger_buffers_are_written_in_place_and_nothing_else(shared):
    """Engines hand out slices of fused buffers: every tensor here is a non-contiguous view
    (every other element of a bigger buffer, quantized data and scales included); the
    elements between must keep their guard values, staging stays within budget + largest."""
    budget = 1024  # several buckets, also with the quantized wire (4096: one)
    results = shared.results_for("strided")
    _assert_all_ok(results)
    assert sum(r.result["checked_tensors"] for r in results) == 2 * 8  # emb, norm, 2 x 3 per layer on 2 ranks
    for r in results:
        assert r.result["staging_peak"] <= budget + r.result["largest_tensor_bytes"]


@pytest.mark.timeout(180)
def test_strided_quantized_sources_non_collocated(tmp_path):
    (tmp_path / "src.layout").write_text("mesh s (tp=2)\ntensor w [64 over tp, 64] mxfp8\ntensor v [32, 64 over tp] fp8_e4m3")
    (tmp_path / "dst.layout").write_text("mesh d (tp=2) at 2\ntensor w [64, 64 over tp] fp32\ntensor v [32 over tp, 64]")
    results = launch({"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "verify": True,
                      "strided": True}, 4, timeout=150)
    _assert_all_ok(results)
    assert [r.result["checked_tensors"] for r in results] == [0, 0, 2, 2]


@pytest.mark.timeout(180)
def test_verify_catches_corruption_on_the_wire(pair):
    src, dst = pair
    results = launch({"src": src, "dst": dst, "verify": True, "corrupt": {"rank": 0},
                      "dst_args": {"AT": 8}}, 10, timeout=150)
    for r in results:
        assert r.result and "verification failed" in r.result.get("error", ""), r.error
        assert "from rank 0" in r.result["error"]


@pytest.mark.timeout(600)  # the first shared case waits for the whole shared launch
@pytest.mark.parametrize("budget", [1024, None], ids=["buckets", "one-bucket"])
def test_overlapped_buckets_are_exact_and_within_the_budget(shared, budget):
    """overlap=True: a bucket's land/quantize/unpack steps run while the next bucket's transfers
    fly; buckets are cut at half the budget so that two live at once stay within it."""
    src, dst = shared.pair
    results = shared.results_for("overlap-buckets" if budget else "overlap-one-bucket")
    _assert_all_ok(results)
    received = sum(r.result["received_bytes"] + r.result["local_bytes"] for r in results)
    assert received == _destination_bytes(src, dst)  # every element once per step (of 3)
    if budget is not None:
        for r in results:
            assert r.result["staging_peak"] <= budget + r.result["largest_tensor_bytes"]


@pytest.mark.timeout(600)  # the first shared case waits for the whole shared launch
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
def test_kept_staging_is_reused_exactly_and_stays_within_the_budget(shared, overlap):
    """On CPU the Refitter carves staging from arenas kept between steps (layoutlang/runtime/staging.py):
    three steps are exact, and what is kept is bounded like the staging itself; with
    keep_staging=False nothing is kept."""
    budget = 1024
    kept, fresh = shared.results_for(f"kept-{overlap}"), shared.results_for(f"fresh-{overlap}")
    _assert_all_ok(kept)
    _assert_all_ok(fresh)
    assert any(r.result["staging_held"] > 0 for r in kept)  # this pair stages on some ranks
    for r in kept:
        assert r.result["staging_held"] <= budget + r.result["largest_tensor_bytes"]
    assert all(r.result["staging_held"] == 0 for r in fresh)


@pytest.mark.timeout(180)
def test_killed_peer_fails_every_survivor_naming_it(pair):
    src, dst = pair
    # linger: rank 0 hosts the store; had it exited at once, a slower survivor would meet a dead
    # store (a RefitError too, tested in test_runtime_faults.py) instead of the reason
    # the bf16 wire at 4096 B: buckets in which every survivor meets rank 1 by bucket 1.
    # store_linger: a survivor whose transfer was with another survivor is freed only when that
    # one exits (after its linger); rank 0 staying longer, its store still holds that one's reason
    # (with every rank lingering alike, rank 0's store could leave with it: "peer rank 9")
    results = launch({"src": src, "dst": dst, "budget": 4096, "timeout": 10, "die": {"rank": 1, "bucket": 1},
                      "dst_args": {"AT": 8}, "linger": 3, "store_linger": 3, "wire": "bf16"}, 10, timeout=150)
    assert results[1].returncode == 3
    for r in results:
        if r.rank == 1:
            continue
        error = r.result["error"]
        assert error.startswith(f"error: rank {r.rank}: step 1, bucket 1: "), error
        assert r.result["outcomes"][0]["peers"] == [1], error
        # its own transfer with rank 1 failing, or another survivor's (relayed: "rank 9 failed
        # in bucket 1: ... with peer rank 1: Connection closed"), or rank 1 missing the bucket
        assert re.search(r"peer rank 1\b", error) or "rank 1 did not finish bucket 1" in error, error


@pytest.mark.timeout(180)
@pytest.mark.parametrize("steady", [False, True])
def test_the_store_does_not_grow_with_steps(tmp_path, steady):
    """Each meeting step adds a count and a gate per meeting (agreement, fence): 4 keys. Over 80
    steps that is 320 keys if nothing is deleted; the Refitter deletes them (deferred at most
    STALE_KEYS keys, plus the two steps still in use). With `steady=True` the steps after step 1
    add none, and step 1's are deleted in step 3."""
    from layoutlang.runtime.refit import STALE_KEYS

    (tmp_path / "src.layout").write_text("mesh s (tp=2)\ntensor w [8 over tp, 4]\n")
    (tmp_path / "dst.layout").write_text("mesh d (tp=2)\ntensor w [8, 4 over tp]\n")
    results = launch({"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "steps": 100,
                      "count_store_keys": True, "steady": steady}, 3, timeout=150)
    _assert_all_ok(results)
    keys = results[0].result["store_keys"]
    assert len(keys) == 100
    if not steady:
        assert keys[-1] - keys[19] <= STALE_KEYS + 2 * 4 < 80 * 4
    else:
        assert keys[2] < keys[0] and keys[3:] == [keys[2]] * 97, keys[:6]


@pytest.mark.timeout(180)
def test_wrong_local_shape_stops_every_rank_before_moving(pair):
    src, dst = pair
    results = launch({"src": src, "dst": dst, "wrong_shape": {"rank": 2}}, 8, timeout=150)
    for r in results:
        error = r.result["error"]
        assert "nothing was moved" in error and "rank 2: source tensor `emb`" in error, error
        assert "expected [52, 32] torch.bfloat16, got [1, 32] torch.bfloat16" in error


@pytest.mark.timeout(180)
def test_ranks_with_different_plans_refuse_to_start(pair):
    src, dst = pair
    results = launch({"src": src, "dst": dst, "dst_args": {"AT": 8}, "odd_args": {"rank": 3, "dst_args": {"AT": 7}}},
                     10, timeout=150)
    for r in results:
        assert r.result and "ranks hold different plans" in r.result["error"] and "[3]" in r.result["error"]


@pytest.mark.timeout(180)
def test_two_sub_groups_refit_the_same_plan_at_once(tmp_path):
    """Refitter(group=...): the plan's ranks are group ranks, peers map to global ranks, and two
    groups run the same plan at once in one store (each meets under its members' namespace)."""
    (tmp_path / "src.layout").write_text("mesh s (tp=2)\ntensor w [48 over tp, 8]\ntensor n [6]\n")
    (tmp_path / "dst.layout").write_text("mesh d (tp=2)\ntensor w [48, 8 over tp] fp32\ntensor n [6] fp16\n")
    results = launch({"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"), "verify": True,
                      "steps": 2, "groups": [[3, 1], [0, 2, 4]]}, 6, timeout=150)
    _assert_all_ok(results)
    assert results[5].result["outside_group"] is True
    # group ranks 0 and 1 hold the plan (torch orders a group's ranks): global 1, 3 and 0, 2; 4 is idle
    assert {r.rank: r.result["checked_tensors"] for r in results if r.rank != 5} == {0: 2, 1: 2, 2: 2, 3: 2, 4: 0}
    for r in results:
        if r.rank in (0, 1, 2, 3):
            # w: [48, 4] fp32 per rank (768 B); n: [6] fp16 (12 B)
            assert r.result["received_bytes"] + r.result["local_bytes"] == 48 * 4 * 4 + 6 * 2


@pytest.mark.timeout(120)
def test_layoutc_run_steady_checks_every_element(tmp_path):
    """`layoutc run --steady --steps 3`: steps 2 and 3 have no store meeting; every element is still
    checked against the layouts after the last one."""
    (tmp_path / "src.layout").write_text("mesh s (tp=2)\ntensor w [8 over tp, 4]\n")
    (tmp_path / "dst.layout").write_text("mesh d (tp=2)\ntensor w [8, 4 over tp]\n")
    proc = subprocess.run([sys.executable, "-m", "layoutlang.cli", "run", str(tmp_path / "src.layout"),
                           str(tmp_path / "dst.layout"), "--nproc", "2", "--steps", "3", "--steady"],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "every element of 2 destination tensors checked: ok" in proc.stdout
