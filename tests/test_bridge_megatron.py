"""The Megatron-Core bridge against real megatron-core models (issue 11).

Multi-process runs (tests/megatron_worker.py, gloo on 127.0.0.1): a tiny GPT
(GQA, SwiGLU, RMSNorm, RoPE) at TP2, a tiny Qwen3-style MoE at EP2 and a
Qwen2-MoE (dense and MoE layers, shared expert) at TP2 x PP2
are described by `layoutlang.bridges.megatron.describe`, refit into an HF
transformers model on one rank through `compile_plan` + `Refitter`, and the
HF logits are compared with Megatron's (gathered over TP): the independent
reference is transformers' own forward pass. Each run refits three times
with an SGD step on the trainer before the second and third refit, and
checks that the engine was behind before each of those refits (so the refit,
not the first one, is what makes the logits equal).

Single-process: the mesh `describe` writes numbers ranks exactly as
Megatron's own RankGenerator does, for several sizes and rank orders.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from layoutlang.runtime.launch import free_port
from megatron_worker import SCENARIOS  # tests/: the scenarios the workers run

from layoutlang import loads
from layoutlang.bridges import megatron as bridge
from layoutlang.bridges.families import layout_text

WORKER = Path(__file__).parent / "megatron_worker.py"
ROOT = Path(__file__).parent.parent
TOLERANCE = 1e-5       # fp32 logits, HF vs Megatron
STEPS = 3              # refits per run (tests/megatron_worker.py)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the test process dies (Linux), so no worker outlives it."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(argv: list[str], nproc: int, timeout: float, tmp: str) -> list[tuple[int | None, str, str]]:
    """Run `argv` as ranks 0..nproc-1 of a gloo group on 127.0.0.1 (the env:// variables torchrun sets);
    (exit code or None if killed at the deadline, stdout, stderr) per rank. Every process is gone on return."""
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out, err = (open(Path(tmp) / f"{kind}{rank}.txt", "w") for kind in ("stdout", "stderr"))
        procs.append((subprocess.Popen([sys.executable, *argv], env=env, stdout=out, stderr=err,
                                       start_new_session=True,
                                       preexec_fn=_die_with_parent), out, err))  # noqa: PLW1509 - prctl only
    deadline = time.monotonic() + timeout
    codes: list[int | None] = [None] * nproc
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p, _, _ in procs):
            time.sleep(0.1)
    finally:
        for rank, (p, out, err) in enumerate(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            else:
                codes[rank] = p.returncode
            out.close()
            err.close()
    return [(codes[r], (Path(tmp) / f"stdout{r}.txt").read_text(), (Path(tmp) / f"stderr{r}.txt").read_text())
            for r in range(nproc)]


def _launch(scenarios: str, timeout: float = 150.0) -> dict[str, list[dict]]:
    """Run the comma-separated scenarios, one after the other, on one set of gloo workers
    (tests/megatron_worker.py); each scenario's per-rank results."""
    names = scenarios.split(",")
    with tempfile.TemporaryDirectory(prefix="megatron-bridge-") as tmp:
        ranks = _spawn([str(WORKER), scenarios, tmp], SCENARIOS[names[0]].world, timeout, tmp)
        out: dict[str, list[dict]] = {}
        for name in names:
            results = []
            for rank, (code, _, stderr) in enumerate(ranks):
                path = Path(tmp) / f"{name}.rank{rank}.json"
                if not path.exists():
                    pytest.fail(f"rank {rank} of {name} left no result (exit {code}; killed at {timeout} s "
                                f"if None):\n{stderr[-2000:]}")
                results.append(json.loads(path.read_text()))
            out[name] = results
    for name, results in out.items():
        for r in results:
            assert r["ok"], f"rank {r['rank']} of {name}: {r.get('error')}"
    return out


def _check_run(scenario: str, results: list[dict], engine_rank: int) -> str:
    """Same text on every rank; it elaborates to every rank's real parameter shapes and to what
    `layoutc new megatron` writes for the same config and sizes; the engine follows the trainer."""
    text = results[0]["text"]
    assert all(r["text"] == text for r in results), "describe() differs between ranks"
    layout = loads(text)
    for r in results:
        described = {t.name: list(t.local_shape_at(r["rank"])) for t in layout.tensors if t.holds(r["rank"])}
        assert described == r["shapes"], f"rank {r['rank']}: layout shapes differ from the model's"
        assert r["tensors_are_views"]
    _check_mesh_against_groups(layout, results)
    s = SCENARIOS[scenario]
    if s.as_layoutc_new:   # `layoutc new megatron` writes the local spec's layout
        written = loads(layout_text(s.config_json(), "megatron", s.sizes()))
        assert _instances(layout) == _instances(written), "describe() and `layoutc new megatron` differ"
    refits = results[engine_rank]["refits"]
    assert len(refits) == STEPS
    for step, refit in enumerate(refits):
        assert refit["max_diff"] <= TOLERANCE, f"refit {step}: logits differ by {refit['max_diff']}"
        assert refit["logit_scale"] > 0.1            # logits of a real scale, not all zero
        # before the refit the engine held other weights (random, then the previous step's)
        assert refit["stale_diff"] > 100 * TOLERANCE, f"refit {step}: the engine was not behind"
    return text


def _instances(layout) -> dict:
    """Per (rank, NAME): dtype, local shape, the keys it holds with their boxes, and where each local
    element lies in the logical tensor (the runs): everything a plan reads, none of the spelling."""
    out = {}
    for t in layout.tensors:
        regions = tuple((r.key, r.box) for r in t.regions) if t.regions else t.key
        for rank in t.ranks():
            out[(rank, t.name)] = (t.dtype, t.local_shape_at(rank), regions, repr(t.runs(rank)))
    return out


def _check_mesh_against_groups(layout, results) -> None:
    """Ranks that differ only along one mesh axis are exactly that axis's parallel_state group."""
    for mesh in layout.meshes:
        names = [a.name for a in mesh.axes]
        for r in results:
            coords = mesh.coords(r["rank"])
            for i, axis in enumerate(names):
                megatron_group = r["groups"][axis]
                along = [mesh.rank(coords[:i] + (c,) + coords[i + 1:]) for c in range(mesh.axes[i].size)]
                assert along == megatron_group, f"mesh {mesh.name} axis {axis} at rank {r['rank']}"


@pytest.mark.timeout(240)
def test_gpt_tp2_refits_into_hf_llama_and_the_logits_match():
    results = _launch("gpt_tp2")["gpt_tp2"]
    text = _check_run("gpt_tp2", results, engine_rank=0)
    # written-out expectations from the model's config (tests/megatron_worker.py)
    assert "mesh train (pp=1, dp=1, tp=2)" in text
    # 90 rows padded to 256 (128 x TP), split over tp; tied: one weight, no output layer at PP=1
    assert "tensor embedding.word_embeddings.weight as model.embed_tokens.weight [V pad 256 over tp, H]" in text
    assert "output_layer" not in text and "lm_head" not in text
    # q/k rows as each head's rotary halves (Megatron's rotate_half, `rotary_interleaved` off)
    assert ("[(KV, (q: (QG, (re: D/2 | im: D/2)) as model.layers.{l}.self_attn.q_proj.weight | "
            "k: (re: D/2 | im: D/2) as model.layers.{l}.self_attn.k_proj.weight | "
            "v: D as model.layers.{l}.self_attn.v_proj.weight)) over tp, H]") in text
    assert ("[(gate: F as model.layers.{l}.mlp.gate_proj.weight | up: F as model.layers.{l}.mlp.up_proj.weight) "
            "over tp, H]") in text
    errors = results[0]["errors"]
    assert "`decoder.layers.1.mlp.extra_scale`" in errors["unknown_parameter"]
    assert "no HF key is known for `mlp.extra_scale`" in errors["unknown_parameter"]
    assert "`decoder.layers.0.self_attention.linear_qkv.weight` is tensor-parallel on dim 1" \
        in errors["wrong_partition_dim"]
    assert "`decoder.layers.0.mlp.linear_fc1.weight` has partition_stride 3" in errors["impossible_stride"]
    assert "vocab_size=257" in errors["vocab_too_large"] and "1..256" in errors["vocab_too_large"]
    assert "unknown model family `mixtrl`" in errors["unknown_family"]
    assert "did you mean `mixtral`?" in errors["unknown_family"]
    assert errors["after_probes"] == "no error"


@pytest.mark.timeout(240)
def test_moe_ep2_refits_into_hf_qwen3_moe_with_stacked_experts_and_the_logits_match():
    # Megatron: qk_layernorm (RMSNorm per head), softmax over the top-2 router logits, SwiGLU experts;
    # HF Qwen3MoeForCausalLM: q_norm/k_norm, softmax then top-2 renormalized: the same architecture.
    results = _launch("moe_ep2")["moe_ep2"]
    text = _check_run("moe_ep2", results, engine_rank=0)
    assert "mesh train (pp=1, dp=2, tp=1)" in text
    assert "mesh experts (pp=1, edp=1, ep=2, etp=1) at 0" in text
    assert "for e in 0..E over ep {" in text
    assert ("tensor decoder.layers.{l}.mlp.experts.local_experts.{e.local}.linear_fc2.weight as "
            "model.layers.{l}.mlp.experts.{e}.down_proj.weight [H, I over etp] on experts") in text
    # local expert ids restart at 0 on each EP rank, the keys carry the global id
    layout = loads(text)
    holders = {(t.name, t.key): sorted(r for r in range(2) if t.holds(r)) for t in layout.tensors
               if t.name.startswith("decoder.layers.0.mlp.experts.local_experts.") and "fc2" in t.name}
    assert holders == {
        ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
         "model.layers.0.mlp.experts.0.down_proj.weight"): [0],
        ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
         "model.layers.0.mlp.experts.1.down_proj.weight"): [0],
        ("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
         "model.layers.0.mlp.experts.2.down_proj.weight"): [1],
        ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
         "model.layers.0.mlp.experts.3.down_proj.weight"): [1]}


@pytest.mark.timeout(400)
def test_qwen2_moe_tp2_pp2_on_four_ranks_refits_into_hf_on_the_last_stage():
    # Qwen2-MoE at TP2 x PP2 (experts over etp=2): dense layers 0 and 2, MoE layers 1 and 3 (one of each
    # per stage), q/k/v biases, a shared expert scaled by sigmoid(gate); HF Qwen2MoeForCausalLM on rank 2
    # (the last stage's first rank, where the full logits are gathered). The same launch runs the uneven
    # stages of issue 49 (`test_uneven_stages`).
    runs = _launch("qwen2_moe_tp2_pp2,deepseek_tp2_pp2_first1,qwen2_moe_tp2_pp2_layout", timeout=330)
    _check_uneven_stages(runs)
    results = runs["qwen2_moe_tp2_pp2"]
    text = _check_run("qwen2_moe_tp2_pp2", results, engine_rank=2)
    assert "mesh train (pp=2, dp=1, tp=2)" in text
    assert "mesh experts (pp=2, edp=1, ep=1, etp=2) at 0" in text
    assert "tensor embedding.word_embeddings.weight as model.embed_tokens.weight [V pad 256 over tp, H] at pp=0" \
        in text
    assert "tensor output_layer.weight as lm_head.weight [V pad 256 over tp, H] at pp=pp-1" in text
    # layer 3 is the second layer of stage 1: local name 1, global key 3
    layout = loads(text)
    names = {t.name: t.key for t in layout.tensors if t.holds(2) and t.name.startswith("decoder.layers.1.mlp.")}
    assert names["decoder.layers.1.mlp.shared_experts.gate_weight"] == "model.layers.3.mlp.shared_expert_gate.weight"
    assert names["decoder.layers.1.mlp.router.weight"] == "model.layers.3.mlp.gate.weight"
    assert "decoder.layers.0.mlp.linear_fc1.weight" in {t.name for t in layout.tensors if t.holds(2)}


def _check_uneven_stages(runs) -> None:
    """Megatron's uneven splits over PP2, described live and refit into HF (logits equal):
    DeepSeek-V3 with num_layers_in_first_pipeline_stage=1 (its dense layer 0 alone on stage 0, MoE
    layers 1 and 2 on stage 1: each stage describes the kind it does not hold from the one it does),
    and Qwen2-MoE with the layout `Ett|t*3L` (stages of 2 and 3). The described shapes are every
    rank's real parameters and every rank's text is the same (`_check_run`), so each stage holds the
    layers megatron-core built on it; `layoutc new megatron --set <the same Megatron-LM arg>` writes
    the same instances; and a layer's NAME is its number on its stage (written out below)."""
    for name, first, layers, dense in (("deepseek_tp2_pp2_first1", 1, 3, [0]),
                                       ("qwen2_moe_tp2_pp2_layout", 2, 5, [0, 2, 4])):
        text = _check_run(name, runs[name], engine_rank=2)
        layout = loads(text)
        on_last = {t.name: t.key for t in layout.tensors if t.holds(2)}   # rank 2: the last stage
        on_first = {t.name: t.key for t in layout.tensors if t.holds(0)}
        assert on_last["decoder.layers.0.input_layernorm.weight"] == \
            f"model.layers.{first}.input_layernorm.weight"
        assert {k for k in on_first.values() if k.endswith(".input_layernorm.weight")} == \
            {f"model.layers.{l}.input_layernorm.weight" for l in range(first)}
        assert {k for k in on_last.values() if k.endswith(".input_layernorm.weight")} == \
            {f"model.layers.{l}.input_layernorm.weight" for l in range(first, layers)}
        # the last layer on the last stage by its stage-local number; dense ones on their stages only
        routed = "mlp.router.weight"
        assert on_last[f"decoder.layers.{layers - 1 - first}.{routed}" if layers - 1 not in dense else
                       f"decoder.layers.{layers - 1 - first}.mlp.linear_fc2.weight"].startswith(
                           f"model.layers.{layers - 1}.mlp.")
        held_dense = sorted(int(k.split(".")[2]) for k in {*on_first.values(), *on_last.values()}
                            if k.endswith(".mlp.down_proj.weight"))
        assert held_dense == dense


@pytest.mark.timeout(240)
def test_the_guides_trainer_loop_runs_as_written():
    # tests/megatron_refit_loop.py is the program of docs/bridges.md's Megatron section, as written:
    # a Megatron GPT trained at TP2 (AdamW, vocab-parallel cross entropy, dropout) feeds an HF Llama on
    # rank 0 every step; it prints the largest logit difference after each refit.
    with tempfile.TemporaryDirectory(prefix="megatron-loop-") as tmp:
        ranks = _spawn([str(Path(__file__).parent / "megatron_refit_loop.py")], 2, 200, tmp)
    for rank, (code, _, stderr) in enumerate(ranks):
        assert code == 0, f"rank {rank} exited {code}:\n{stderr[-2000:]}"
    lines = [line for line in ranks[0][1].splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"]
    for line in lines:
        assert float(line.rsplit(" ", 1)[1]) <= TOLERANCE, line


# ---- single process: the mesh numbers ranks as Megatron does ------------------------------------

ORDERS = [  # (tp, cp, dp, pp, ep, etp, order)
    (2, 1, 1, 1, 1, 2, "tp-cp-ep-dp-pp"),
    (2, 1, 2, 2, 1, 2, "tp-cp-ep-dp-pp"),
    (2, 2, 2, 1, 1, 2, "tp-cp-ep-dp-pp"),
    (2, 1, 2, 2, 1, 2, "tp-cp-ep-pp-dp"),
    (4, 1, 2, 2, 4, 1, "tp-cp-ep-dp-pp"),
    (2, 1, 4, 1, 2, 2, "tp-cp-ep-dp-pp"),
    (1, 1, 4, 2, 1, 1, "tp-pp-dp"),
    (2, 1, 2, 2, 1, 2, "tp-pp-dp"),
]


def _generator_groups(tp, cp, dp, pp, ep, etp, order):
    """Megatron's own groups: {axis: list of groups} for the dense and the expert view."""
    from megatron.core.parallel_state import RankGenerator

    world = tp * cp * dp * pp
    edp = world // (etp * ep * pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    return world, ({"pp": (pp, dense.get_ranks("pp")), "dp": (dp, dense.get_ranks("dp")),
                    "cp": (cp, dense.get_ranks("cp")), "tp": (tp, dense.get_ranks("tp"))},
                   {"pp": (pp, expert.get_ranks("pp")), "edp": (edp, expert.get_ranks("dp")),
                    "ep": (ep, expert.get_ranks("ep")), "etp": (etp, expert.get_ranks("tp"))})


@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp,order", ORDERS, ids=[f"tp{o[0]}cp{o[1]}dp{o[2]}pp{o[3]}ep{o[4]}"
                                                                  f"etp{o[5]}-{o[6]}" for o in ORDERS])
def test_mesh_numbers_ranks_as_megatron_rank_generator(tp, cp, dp, pp, ep, etp, order):
    world, views = _generator_groups(tp, cp, dp, pp, ep, etp, order)
    for view in views:
        texts = set()
        for rank in range(world):
            groups = [bridge.Group(name, size, tuple(next(g for g in groups if rank in g)))
                      for name, (size, groups) in view.items()]
            axes = bridge.mesh_axes(groups, rank, world)
            texts.add(axes.text("m"))
            mesh = loads(axes.text("m") + "\ntensor w [1]").meshes[0]
            assert mesh.coords(rank) == axes.coords
            for i, (name, size) in enumerate(axes.axes):   # the ranks along each axis: Megatron's group
                along = [mesh.rank(axes.coords[:i] + (c,) + axes.coords[i + 1:]) for c in range(size)]
                assert along == next(g for g in view[name][1] if rank in g), (name, rank)
        assert len(texts) == 1, "the mesh differs between ranks"


def test_mesh_of_the_default_order_lists_pp_dp_tp_with_tp_fastest():
    world, (dense, expert) = _generator_groups(2, 1, 2, 2, 2, 1, "tp-cp-ep-dp-pp")
    rank = 5
    pick = lambda view: [bridge.Group(n, s, tuple(next(g for g in gs if rank in g)))
                         for n, (s, gs) in view.items()]
    assert bridge.mesh_axes(pick(dense), rank, world).text("train") == "mesh train (pp=2, dp=2, cp=1, tp=2)"
    assert bridge.mesh_axes(pick(expert), rank, world).text("experts", at=True) == \
        "mesh experts (pp=2, edp=2, ep=2, etp=1) at 0"  # 8 ranks / (pp 2 x ep 2)
    # rank 5 = pp 1 (ranks 4-7), dp 0, tp 1 (written out from Megatron's order: tp fastest, then dp, then pp)
    assert bridge.mesh_axes(pick(dense), rank, world).coords == (1, 0, 0, 1)


def test_groups_that_no_mesh_numbers_are_refused():
    groups = [bridge.Group("dp", 2, (0, 1)), bridge.Group("tp", 2, (0, 3))]   # tp stride 3 in a world of 4
    with pytest.raises(bridge.BridgeError, match="axis tp \\(size 2\\) has stride 3"):
        bridge.mesh_axes(groups, 0, 4)
    with pytest.raises(bridge.BridgeError, match="not evenly spaced"):
        bridge.mesh_axes([bridge.Group("tp", 3, (0, 1, 3))], 0, 4)
    with pytest.raises(bridge.BridgeError, match="cover 2 ranks but the process group has 4"):
        bridge.mesh_axes([bridge.Group("tp", 2, (0, 1))], 0, 4)
