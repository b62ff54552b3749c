"""Multi-process refits on gloo: real processes on 127.0.0.1, hard timeouts, cleanup.

Each test launches local workers (`layoutlang.runtime.launch`): every worker
compiles the same plan, fills its source tensors from logical coordinates,
refits, and checks every destination element (padding zero, quantized
tensors equal to quantizing the reference, storage updated in place).
"""

import pytest

from layoutlang.runtime.launch import launch

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


def _assert_all_ok(results):
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error} {r.result and r.result.get('check_errors')}"


@pytest.mark.timeout(180)
def test_collocated_quantized_padded_gtp_with_buckets_and_verify(pair):
    src, dst = pair
    budget = 4096
    results = launch({"src": src, "dst": dst, "verify": True, "budget": budget, "steps": 3}, 8, timeout=150)
    _assert_all_ok(results)
    received = sum(r.result["received_bytes"] + r.result["local_bytes"] for r in results)
    assert received > 0
    for r in results:  # staging stays under the budget plus the largest tensor
        assert r.result["staging_peak"] <= budget + r.result["largest_tensor_bytes"]


@pytest.mark.timeout(180)
def test_non_collocated_with_idle_ranks_and_quantized_source(tmp_path):
    (tmp_path / "src.layout").write_text(
        "mesh s (dp=2, tp=2)\ntensor w [64 over tp, 32] fp8_e4m3\ntensor b [64, 64 over tp] mxfp8\n"
        "tensor n [8] fp32")
    (tmp_path / "dst.layout").write_text(
        "mesh d (tp=2) at 5\ntensor w [64, 32 over tp]\ntensor b [64 over tp, 64] bf16\ntensor n [8] bf16")
    results = launch({"src": str(tmp_path / "src.layout"), "dst": str(tmp_path / "dst.layout"),
                      "verify": True}, 8, timeout=150)  # ranks 4 and 7 hold nothing
    _assert_all_ok(results)
    assert results[4].result["sent_bytes"] == results[4].result["received_bytes"] == 0


@pytest.mark.timeout(180)
def test_verify_catches_corruption_on_the_wire(pair):
    src, dst = pair
    results = launch({"src": src, "dst": dst, "verify": True, "corrupt": {"rank": 0},
                      "dst_args": {"AT": 8}}, 10, timeout=150)
    for r in results:
        assert r.result and "verification failed" in r.result.get("error", ""), r.error
        assert "from rank 0" in r.result["error"]


@pytest.mark.timeout(180)
def test_killed_peer_fails_every_survivor_naming_it(pair):
    src, dst = pair
    results = launch({"src": src, "dst": dst, "budget": 4096, "timeout": 10, "die": {"rank": 1, "bucket": 1},
                      "dst_args": {"AT": 8}}, 10, timeout=150)
    assert results[1].returncode == 3
    for r in results:
        if r.rank == 1:
            continue
        error = r.result["error"]
        assert f"rank {r.rank}: bucket 1" in error and "peer rank" in error and "1" in error, error


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
