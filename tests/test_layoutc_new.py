"""`layoutc new FRAMEWORK --config config.json`: every family in every convention, and every pair plans.

References, independent of layoutlang.bridges.families:
- the checkpoint transformers itself writes for a tiny model of each family
  (`save_pretrained`: per-expert names, shapes), for the keys every convention
  must hold and for the NAMEs of the `hf` convention;
- the slow simulator (tests/plan_simulator.py) for every pair of conventions:
  each destination element written exactly once, with its value;
- the live model (`layoutlang.bridges.hf.describe` checks every parameter of it)
  for `hf-memory`;
- hand-computed slices for a few ops (written out in the test).
"""

import itertools
import json
from pathlib import Path

import pytest

from layoutlang import compile_plan, load, loads
from layoutlang.bridges.families import CONVENTIONS
from layoutlang.cli import main
from plan_simulator import RunsView, check_stats, simulate

# Tiny configs of every family (fp32, sizes that split over TP2 / EP2 / PP2).
CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=500),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=500, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=500),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=500, num_local_experts=4),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=500, num_experts=4, mlp_only_layers=[0]),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                      vocab_size=500, num_experts=4),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, vocab_size=500,
                        n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=2, q_lora_rank=32,
                        kv_lora_rank=28, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_group=1,
                        topk_group=1, num_experts_per_tok=2),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=8, vocab_size=500,
                    num_local_experts=4, num_experts_per_tok=2),
}
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"}
for _cfg in CONFIGS.values():
    _cfg["dtype"] = "float32"

# The args each convention declares (docs/bridges.md), and the sizes the pair tests use.
ARGS = {"megatron": ["TP", "PP", "DP", "EP", "ETP", "AT"], "hf": ["DP", "AT"], "hf-memory": ["DP", "AT"],
        "vllm": ["TP", "DP", "EP", "AT"], "sglang": ["TP", "DP", "EP", "AT"]}
SIZES = {"megatron": {"TP": 2, "PP": 2, "DP": 2, "EP": 2, "ETP": 1},   # 8 ranks, experts edp=2 x ep=2
         "hf": {"DP": 2},
         "hf-memory": {"AT": 5},
         "vllm": {"TP": 2, "DP": 2, "EP": 2, "AT": 3},                   # ranks 3-6, partly collocated
         "sglang": {"TP": 2, "EP": 2, "AT": 1}}


def _args(family: str, convention: str) -> list[str]:
    """The args of `family`'s layout in `convention` (EP and ETP only where there are experts)."""
    return [a for a in ARGS[convention] if family in MOE or a not in ("EP", "ETP")]


def _sets(family: str, convention: str) -> list[str]:
    out = []
    for name, value in SIZES[convention].items():
        if name in _args(family, convention):
            out += ["--set", f"{name}={value}"]
    return out


@pytest.fixture(scope="module")
def config_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    out = {}
    for family, cfg in CONFIGS.items():
        out[family] = folder / f"{family}.json"
        out[family].write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def layouts(config_files, tmp_path_factory):
    """`layoutc new` of every family in every convention, written to files (path per pair)."""
    folder = tmp_path_factory.mktemp("layouts")
    out = {}
    for family in CONFIGS:
        for convention in CONVENTIONS:
            path = folder / f"{family}_{convention}.layout"
            assert main(["new", convention, "--config", str(config_files[family]), *_sets(family, convention),
                         "-o", str(path)]) == 0
            out[family, convention] = path
    return out


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_each_output_checks_is_formatted_and_declares_its_args(layouts, family, convention, capsys):
    path = str(layouts[family, convention])
    assert main(["check", path]) == 0
    assert main(["fmt", "--check", path]) == 0
    capsys.readouterr()
    layout = load(path)
    assert [name for name, _ in layout.args] == _args(family, convention)
    expected = {name: 0 if name == "AT" else 1 for name in _args(family, convention)}  # defaults
    expected.update({n: v for n, v in SIZES[convention].items() if n in expected})  # --set
    assert dict(layout.args) == expected


def test_megatron_expert_tp_defaults_to_tp(config_files, capsys):
    """Megatron-LM's --expert-tensor-parallel-size defaults to the tensor-parallel size."""
    assert main(["new", "megatron", "--config", str(config_files["mixtral"]), "--set", "TP=2", "--set", "DP=2",
                 "--set", "EP=2"]) == 0
    layout = loads(capsys.readouterr().out)
    assert dict(layout.args) == {"TP": 2, "PP": 1, "DP": 2, "EP": 2, "ETP": 2, "AT": 0}


def test_stdout_and_the_args_stay_overridable(config_files, capsys, tmp_path):
    assert main(["new", "vllm", "--config", str(config_files["llama"]), "--set", "TP=2"]) == 0
    text = capsys.readouterr().out
    assert "arg TP = 2\n" in text and "mesh infer (dp=DP, tp=TP) at AT\n" in text
    path = tmp_path / "llama_vllm.layout"
    path.write_text(text)
    assert load(str(path)).ranks == 2
    assert load(str(path), {"TP": 4, "DP": 2}).ranks == 8  # `--set TP=4` later: 8 heads, 2 kv heads replicated


# ---- keys: the names transformers writes in its checkpoint ------------------------------------------

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> {checkpoint key: shape} of a tiny model saved by transformers (per-expert names)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    out = {}
    for family, cfg in CONFIGS.items():
        cfg = dict(cfg)
        conf = transformers.CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(conf)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(str(folder))
        keys = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), "pt") as fh:
                for key in fh.keys():
                    keys[key] = tuple(fh.get_slice(key).get_shape())
        out[family] = keys
    return out


def _per_expert_gpt_oss(stacked: dict[str, tuple]) -> dict[str, tuple]:
    """gpt-oss's checkpoint stacks its experts; the convention names one expert's weights like the
    other families (LANGUAGE.md 8.2): gate_up_proj [E, H, 2I] -> gate/up_proj.weight [I, H] per expert,
    down_proj [E, I, H] -> down_proj.weight [H, I], biases [E, 2I] -> [I] each, [E, H] -> [H]."""
    out = {}
    for name, shape in stacked.items():
        if ".mlp.experts." not in name:
            out[name] = shape
            continue
        prefix, kind = name.rsplit(".", 1)
        experts = shape[0]
        for e in range(experts):
            one = f"{prefix}.{e}"
            if kind == "gate_up_proj":
                out[f"{one}.gate_proj.weight"] = out[f"{one}.up_proj.weight"] = (shape[2] // 2, shape[1])
            elif kind == "down_proj":
                out[f"{one}.down_proj.weight"] = (shape[2], shape[1])
            elif kind == "gate_up_proj_bias":
                out[f"{one}.gate_proj.bias"] = out[f"{one}.up_proj.bias"] = (shape[1] // 2,)
            else:
                assert kind == "down_proj_bias"
                out[f"{one}.down_proj.bias"] = (shape[1],)
    return out


def _keys(layout) -> dict[str, tuple]:
    out = {}
    for key, held in layout.key_index.items():
        shapes = {r.key_shape if r is not None else t.logical_shape for t, r in held}
        assert len(shapes) == 1, (key, shapes)
        out[key] = shapes.pop()
    return out


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_keys_are_the_checkpoint_names_with_their_shapes(layouts, checkpoints, family, convention):
    layout = load(str(layouts[family, convention]))
    expected = checkpoints[family]
    if family == "gpt_oss":
        expected = _per_expert_gpt_oss(expected)
    assert _keys(layout) == expected
    if convention == "hf":  # the checkpoint itself: NAMEs and stored shapes are the file's
        assert {t.name: t.local_shape for t in layout.tensors} == checkpoints[family]


# ---- every pair plans, and the simulator finds every element written once -------------------------------

PAIRS = list(itertools.permutations(CONVENTIONS, 2))


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_every_pair_of_conventions_plans_and_moves_every_element_once(layouts, family, src, dst):
    plan = compile_plan(str(layouts[family, src]), str(layouts[family, dst]))
    report = simulate(RunsView(plan.src), RunsView(plan.dst), plan)
    check_stats(plan, report)
    assert plan.unused_keys == []


def test_a_vllm_qkv_op_by_hand(layouts):
    """llama (Q=8 heads, KV=2, D=8) from the HF checkpoint (rank 0, DP=2) into vLLM TP2 x DP2 at
    rank 3: engine rank 4 is tp rank 1 of dp 0; its qkv_proj holds q rows 32..64, then k rows 8..16,
    then v rows 8..16 of the checkpoint's q_proj / k_proj / v_proj (rows = heads x D)."""
    # without relays: a replica of dp 1 may forward these otherwise (tests/test_relay.py)
    plan = compile_plan(str(layouts["llama", "hf"]), str(layouts["llama", "vllm"]), relay=False)
    ops = [op for op in plan.ops if op.dst_rank == 4 and op.dst_name == "model.layers.1.self_attn.qkv_proj.weight"]
    got = sorted((op.key.rsplit(".", 2)[-2], op.src_slice[0], op.dst_slice[0]) for op in ops)
    assert got == [("k_proj", (8, 16), (32, 40)), ("q_proj", (32, 64), (0, 32)), ("v_proj", (8, 16), (40, 48))]
    assert all(op.src_name == op.key and op.src_rank in (0, 1) for op in ops)


def test_megatron_stage_local_names_and_experts_by_hand(layouts):
    """qwen3_moe (2 layers, 4 experts) in Megatron PP2 x DP2 x TP2, EP2 x ETP1: stage 1 (ranks 4-7)
    calls layer 1 `decoder.layers.0`; ep rank 1 of the expert mesh (edp, ep, etp=1: ranks 5 and 7 on
    stage 1) holds experts 2 and 3 as local experts 0 and 1; into vLLM's EP2 w13 at ranks 3-6."""
    src = load(str(layouts["qwen3_moe", "megatron"]))
    fc1 = [t for t in src.tensors if t.name == "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    stage1 = [t for t in fc1 if 5 in t.ranks()]
    assert [sorted(t.ranks()) for t in stage1] == [[5, 7]]
    assert [r.key for r in stage1[0].regions] == ["model.layers.1.mlp.experts.3.gate_proj.weight",
                                                  "model.layers.1.mlp.experts.3.up_proj.weight"]
    plan = compile_plan(src, load(str(layouts["qwen3_moe", "vllm"])))
    # vLLM: experts (ep=2, etp=DP*TP/EP=2) from rank 3: ep rank 1 = ranks 5, 6; etp rank 0 = rank 5
    ops = [op for op in plan.ops if op.dst_rank == 5 and op.dst_name == "model.layers.1.mlp.experts.routed_experts.w13_weight"
           and ".experts.3." in op.key]
    got = sorted((op.key.rsplit(".", 2)[-2], op.dst_slice) for op in ops)
    assert got == [("gate_proj", ((1, 2), (0, 16), (0, 64))), ("up_proj", ((1, 2), (16, 32), (0, 64)))]
    assert all(op.src_name == "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
               and op.src_rank in (5, 7) for op in ops)


# ---- hf-memory is what the HF bridge describes for the model built from the same config ----------------------

def _semantics(layout) -> dict:
    """What an elaborated layout says, without its text: per stored tensor its keys and regions,
    dims, dtype, shapes and, per rank that holds it, the runs of every dim."""
    out = {}
    for t in layout.tensors:
        keys = (tuple((r.key, r.box, r.stacked, r.transposed, r.part_dim) for r in t.regions)
                if t.regions is not None else ((t.key,),))
        runs = {rank: t.runs(rank) for rank in t.ranks()}
        out[t.name] = (keys, t.dims, t.dtype, t.logical_shape, t.local_shape, runs)
    return out


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("at", [0, 3])
def test_new_hf_memory_equals_the_hf_bridge_on_a_model_of_that_config(config_files, family, at, capsys):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from layoutlang.bridges import hf

    cfg = dict(CONFIGS[family])
    conf = transformers.CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(conf)
    described = loads(hf.describe(model, at=at), "described")
    assert main(["new", "hf-memory", "--config", str(config_files[family]), "--set", f"AT={at}"]) == 0
    new = loads(capsys.readouterr().out, "new")
    assert described.ranks == new.ranks == at + 1
    assert _semantics(described) == _semantics(new)


# ---- what goes wrong is said plainly -------------------------------------------------------------------------------

def _run(argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err


def test_unknown_model_type_is_a_usage_error_naming_it(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    code, err = _run(["new", "vllm", "--config", str(path)], capsys)
    assert code == 2
    assert err == (f"error: {path}: model_type `bert` is not a family `layoutc new` knows\n"
                   "help: known families: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, "
                   "deepseek_v3, gpt_oss\n")


@pytest.mark.parametrize("family,field", [("llama", "intermediate_size"), ("qwen3_moe", "moe_intermediate_size"),
                                          ("deepseek_v3", "kv_lora_rank"), ("mixtral", "num_local_experts")])
def test_a_missing_field_is_a_usage_error_naming_the_field_and_file(tmp_path, capsys, family, field):
    cfg = {k: v for k, v in CONFIGS[family].items() if k != field}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, err = _run(["new", "megatron", "--config", str(path)], capsys)
    assert code == 2
    assert err.startswith(f"error: {path}: missing field `{field}` (model_type {family} needs it)\n")
    assert f'help: add "{field}": ... to {path}' in err


def test_a_wrong_value_is_named(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIGS["llama"], "num_hidden_layers": "2"}))
    code, err = _run(["new", "hf", "--config", str(path)], capsys)
    assert code == 2
    assert err == f"error: {path}: field `num_hidden_layers` is '2', expected a positive integer\n"


def test_config_that_is_not_json_is_positioned(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    code, err = _run(["new", "hf", "--config", str(path)], capsys)
    assert code == 2
    assert err.startswith(f"{path}:2:21: error: --config {path}: not JSON: "
                          "Expecting property name enclosed in double quotes\n")
    assert '    2 |   "hidden_size": 64,,\n' in err and "      |                     ^\n" in err  # the second comma


def test_missing_config_and_an_arg_the_convention_lacks(tmp_path, capsys, config_files):
    code, err = _run(["new", "hf", "--config", str(tmp_path / "none.json")], capsys)
    assert code == 2 and err.startswith(f"error: cannot read {tmp_path / 'none.json'}: ")
    code, err = _run(["new", "vllm", "--config", str(config_files["llama"]), "--set", "EP=2"], capsys)
    assert code == 2
    assert err == ("error: --set EP=2: the vllm layout of llama has no arg EP\n"
                   "help: its args: TP, DP, AT\n")


def test_sizes_that_do_not_divide_are_diagnostics_in_the_generated_text(config_files, capsys):
    """8 query heads in 2 groups over TP3: Megatron's grouped QKV cannot be split."""
    code, err = _run(["new", "megatron", "--config", str(config_files["llama"]), "--set", "TP=3"], capsys)
    assert code == 1
    head = err.splitlines()[0]
    assert head.startswith("<layoutc new megatron>:") and head.endswith(
        "error: split (2, ...) over tp=3: 2 copies are neither a multiple nor a divisor of 3")
    assert "self_attention.linear_qkv.weight" in err.splitlines()[1]


def test_new_is_listed_in_the_help(capsys):
    assert main(["new", "--help"]) == 0
    out = capsys.readouterr().out
    assert "megatron, hf, hf-memory, vllm, sglang" in out and "--config" in out


QWEN3_30B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
             "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "tie_word_embeddings": False, "torch_dtype": "bfloat16"}  # Qwen3-30B-A3B


def test_the_session_of_docs_bridges_is_what_layoutc_prints(tmp_path, capsys, monkeypatch):
    """docs/bridges.md's `layoutc new` session on Qwen3-30B-A3B's config: every line it shows (its
    elided lines aside) is in the real output, in order, and the two files plan as it says."""
    doc = (Path(__file__).parent.parent / "docs" / "bridges.md").read_text()
    session = doc.split("```\n$ layoutc new vllm")[1].split("```")[0]
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B))
    monkeypatch.chdir(tmp_path)
    commands = [line[2:] for line in ("$ layoutc new vllm" + session).splitlines() if line.startswith("$ ")]
    assert len(commands) == 4
    shown = [line for line in ("$ layoutc new vllm" + session).splitlines()
             if not line.startswith("$ ") and "..." not in line.replace("--set TP=...", "")]
    printed = []
    for command in commands:
        argv = command.split("#")[0].split()[1:]
        assert main(argv) == 0
        printed += capsys.readouterr().out.splitlines()
    at = 0
    for line in shown:  # in order
        at = printed.index(line, at) + 1
    plan = compile_plan(str(tmp_path / "train.layout"), str(tmp_path / "infer.layout"))
    assert "59.88 GiB" in session and round(plan.stats["bytes"] / 2**30, 2) == 59.88


# ---- the hand-written small v2 examples: another author's reading of the same frameworks ----------------

SMALL_V2 = Path(__file__).parent.parent / "examples" / "small" / "v2"
EXAMPLE_CONFIGS = {  # configs of the sizes examples/small/v2 uses, and the examples they pair with
    "llama": (dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=16, num_key_value_heads=2, vocab_size=900),
              ["llama_hf", "llama_megatron", "llama_vllm", "llama_fsdp2"]),
    "moe": (dict(model_type="qwen3_moe", hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=8, vocab_size=500, num_experts=8),
            ["moe_hf", "moe_megatron", "moe_vllm"]),
    "mla": (dict(model_type="deepseek_v3", hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=8, vocab_size=500, n_routed_experts=4, n_shared_experts=1,
                 first_k_dense_replace=0, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=4,
                 qk_nope_head_dim=8, v_head_dim=8),
            ["mla_megatron", "mla_vllm"]),
    "gptoss": (dict(model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=8, vocab_size=500, num_local_experts=4),
               ["gptoss_hf", "gptoss_megatron", "gptoss_vllm"]),
}
EXAMPLE_PAIRS = [(model, convention, example) for model, (_, examples) in EXAMPLE_CONFIGS.items()
                 for convention in CONVENTIONS for example in examples]


@pytest.mark.parametrize("model,convention,example", EXAMPLE_PAIRS,
                         ids=[f"{m}-{c}->{e}" for m, c, e in EXAMPLE_PAIRS])
def test_each_convention_feeds_the_hand_written_examples(model, convention, example):
    """Every key of examples/small/v2 (written by hand from the frameworks, some of them only a model's
    experts or attention) is in `layoutc new`'s output with its logical shape and part tree, and the
    simulator finds every element of the example written once."""
    cfg = EXAMPLE_CONFIGS[model][0]
    sizes = {n: v for n, v in {"TP": 2, "EP": 2, "ETP": 1, "DP": 2}.items() if n in _args(cfg["model_type"], convention)}
    src = loads(render_new(cfg, convention, sizes), convention)
    path = SMALL_V2 / f"{example}.layout"
    dst = load(str(path), {"AT": 4} if "AT" in path.read_text() else None)
    plan = compile_plan(src, dst)
    check_stats(plan, simulate(RunsView(plan.src), RunsView(plan.dst), plan))


def test_the_hf_checkpoint_of_the_small_llama_is_the_hand_written_one():
    """Both whole models: `layoutc new hf` and examples/small/v2/llama_hf.layout say the same thing."""
    cfg = EXAMPLE_CONFIGS["llama"][0]
    new = loads(render_new(cfg, "hf", {"AT": 3}), "new")
    example = load(str(SMALL_V2 / "llama_hf.layout"), {"AT": 3})
    assert _semantics(new) == _semantics(example)


def render_new(cfg: dict, convention: str, sizes: dict) -> str:
    from layoutlang.bridges.families import layout_text

    return layout_text(cfg, convention, sizes)


def test_vllm_expert_placements_are_written_as_vllm_builds_them(tmp_path, capsys):
    """`--expert-placement` (vLLM's --expert-placement-strategy): linear is `over ep balanced`
    (the first E mod EP ranks one more), round_robin `over ep cyclic` (docs/language.md 14.8);
    other conventions place experts in blocks and refuse it."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIGS["qwen3_moe"]))
    assert CONFIGS["qwen3_moe"]["num_experts"] == 4  # over 3 ranks, by vLLM's determine_expert_map:
    expected = {"linear": [[0, 1], [2], [3]], "round_robin": [[0, 3], [1], [2]]}
    for placement, word in (("linear", "balanced"), ("round_robin", "cyclic")):
        assert main(["new", "vllm", "--config", str(config), "--set", "TP=1", "--set", "DP=3", "--set", "EP=3",
                     "--expert-placement", placement]) == 0
        text = capsys.readouterr().out
        assert f"routed_experts.w13_weight [e in 0..E over ep {word}," in text
        w13 = next(t for t in loads(text).tensors if t.name == "model.layers.0.mlp.experts.routed_experts.w13_weight")
        held = [[r.logical_start + i for r in w13.runs(rank)[0] for i in range(r.length)] for rank in range(3)]
        assert held == expected[placement]
    assert main(["new", "hf", "--config", str(config), "--expert-placement", "round_robin"]) == 2
    assert "expert placement `round_robin` is vLLM's" in capsys.readouterr().err


# ---- the flat-shard trainers: `new deepspeed` / `new fsdp1` write what their live bridges describe ----------------
# The expected lines are the ones tests/test_bridge_deepspeed.py and tests/test_bridge_fsdp1.py assert for the live
# describe() of their tiny models (written by hand from DeepSpeed's and FSDP1's rules); the configs are those
# models' (tests/deepspeed_zero3_program.py's CONFIG and MOE, tests/fsdp1_refit_program.py's Llama), as config.json.

def _flat_new(tmp_path, capsys, cfg: dict, framework: str, *sets: str) -> str:
    path = tmp_path / f"{framework}_{cfg['model_type']}.json"
    path.write_text(json.dumps(cfg))
    assert main(["new", framework, "--config", str(path), *(a for s in sets for a in ("--set", s))]) == 0
    return capsys.readouterr().out


ZERO3_LLAMA = dict(model_type="llama", vocab_size=37, hidden_size=6, intermediate_size=24, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, dtype="float32", architectures=["LlamaForCausalLM"])
ZERO3_MOE = dict(model_type="qwen3_moe", vocab_size=37, hidden_size=6, intermediate_size=12, moe_intermediate_size=5,
                 num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=4, tie_word_embeddings=False, dtype="float32", decoder_sparse_step=1,
                 mlp_only_layers=[], norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
FSDP1_LLAMA = {**ZERO3_LLAMA, "hidden_size": 18}
# a decoder layer's parameters in transformers' registration order (test_bridge_fsdp1.LAYER's order, by hand)
LAYER_ORDER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]


def _plans_with(text: str, engine) -> None:
    """The flat layout pairs with the engine's, both ways, every destination element written once (the
    slow simulator)."""
    flat = loads(text, "flat")
    for src, dst in ((flat, engine), (engine, flat)):
        plan = compile_plan(src, dst)
        check_stats(plan, simulate(RunsView(plan.src), RunsView(plan.dst), plan))
        assert plan.unused_keys == []


def test_new_deepspeed_is_what_the_zero3_bridge_describes(tmp_path, capsys):
    text = _flat_new(tmp_path, capsys, ZERO3_LLAMA, "deepspeed", "DP=4")
    # test_bridge_deepspeed.py's lines for the live describe() of this model on 4 ranks
    assert "\nlayout llamaforcausallm_zero3\n\nmesh zero (dp=4)\ndefault dtype fp32\n\n" in text
    assert "tensor model.norm.weight.ds_tensor [flat([6] as model.norm.weight) pad dp over dp]\n" in text
    assert ("tensor model.embed_tokens.weight.ds_tensor [flat([37, 6] as model.embed_tokens.weight) "
            "pad dp over dp]\n") in text
    assert ("tensor model.layers.1.self_attn.q_proj.weight.ds_tensor [flat([(2, (re: 4/2 | im: 4/2)), 6] as "
            "model.layers.1.self_attn.q_proj.weight) pad dp over dp]\n") in text
    # one tensor per parameter, in named_parameters() order: the embedding, each layer, the norm, lm_head
    layers = [f"model.layers.{l}.{p}.weight" for l in range(2) for p in LAYER_ORDER]
    names = ["model.embed_tokens.weight", *layers, "model.norm.weight", "lm_head.weight"]
    assert [line.split()[1] for line in text.splitlines() if line.startswith("tensor ")] == [
        n + ".ds_tensor" for n in names]
    # each rank's partition: DeepSpeed's ceil(numel / W) elements, by hand
    layout = loads(text, "zero3")
    by_name = {t.name: t for t in layout.tensors}
    for name, size in (("model.norm.weight", 2), ("model.embed_tokens.weight", 56),   # 6 / 4, 222 / 4
                       ("model.layers.0.mlp.down_proj.weight", 36), ("model.layers.1.self_attn.o_proj.weight", 12)):
        assert [by_name[name + ".ds_tensor"].local_shape_at(r) for r in range(4)] == [(size,)] * 4, name
    (tmp_path / "zero3.layout").write_text(text)
    assert main(["fmt", "--check", str(tmp_path / "zero3.layout")]) == 0
    _plans_with(text, loads(_flat_new(tmp_path, capsys, ZERO3_LLAMA, "vllm", "TP=2"), "vllm"))
    # Qwen3-MoE: the stacked experts one flat key per expert and part, in storage order (the bridge test's lines);
    # transformers builds a Qwen3-MoE block's experts before its router (gate)
    moe = _flat_new(tmp_path, capsys, ZERO3_MOE, "deepspeed", "DP=4")
    keys = " | ".join(f"[5, 6] as model.layers.0.mlp.experts.{e}.{part}_proj.weight"
                      for e in range(4) for part in ("gate", "up"))
    assert f"tensor model.layers.0.mlp.experts.gate_up_proj.ds_tensor [flat({keys}) pad dp over dp]\n" in moe
    keys = " | ".join(f"[6, 5] as model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4))
    assert f"tensor model.layers.0.mlp.experts.down_proj.ds_tensor [flat({keys}) pad dp over dp]\n" in moe
    assert "\nlayout qwen3moeforcausallm_zero3\n" in moe and moe.count("\ntensor ") == 3 + 11  # 9 + q/k norms
    assert moe.index("mlp.experts.down_proj.ds_tensor") < moe.index("mlp.gate.weight.ds_tensor")
    gate_up = next(t for t in loads(moe, "moe").tensors if t.name.endswith("gate_up_proj.ds_tensor"))
    assert [gate_up.local_shape_at(r) for r in range(4)] == [(60,)] * 4  # 4 x 10 x 6 = 240 / 4


def test_new_fsdp1_is_what_the_fsdp1_bridge_describes(tmp_path, capsys):
    from test_bridge_fsdp1 import LAYER, ROOT

    root = "_fsdp_wrapped_module._flat_param"
    layer0 = "_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module._flat_param"
    layer1 = layer0.replace("layers.0", "layers.1")
    # test_bridge_fsdp1.py's lines and local sizes (675 / 954 per rank, aligned 677 / 955), by hand from FSDP1's rule;
    # q/k rows as rotary halves, as `layoutc new vllm` writes them: a flat key pairs strictly
    vllm = loads(_flat_new(tmp_path, capsys, FSDP1_LLAMA, "vllm", "TP=2"), "vllm")
    for orig, align, sizes in ((0, "", (675, 954)), (1, " align 4", (677, 955))):
        text = _flat_new(tmp_path, capsys, FSDP1_LLAMA, "fsdp1", "DP=2", f"ORIG={orig}")
        assert "\nmesh fsdp (dp=2)\n" in text
        assert f"tensor {root} [flat({ROOT}){align} pad dp over dp] fp32\n" in text
        assert f"tensor {layer0} [flat({LAYER}){align} pad dp over dp] fp32\n" in text
        assert text.count("tensor ") == 3
        by_name = {t.name: t for t in loads(text, "fsdp1").tensors}
        for r in range(2):
            assert [by_name[n].local_shape_at(r) for n in (root, layer0, layer1)] == [
                (sizes[0],), (sizes[1],), (sizes[1],)]
        _plans_with(text, vllm)  # with `layoutc new vllm --set TP=2`, both ways
    # a tied lm_head is the embedding's one key (test_bridge_fsdp1's tied model)
    tied = _flat_new(tmp_path, capsys, {**FSDP1_LLAMA, "tie_word_embeddings": True}, "fsdp1", "DP=2", "ORIG=1")
    assert (f"tensor {root} [flat([37, 18] as model.embed_tokens.weight | [18] as model.norm.weight) align 4 pad dp "
            "over dp] fp32\n") in tied
    # bf16 parameters: 16 bytes are 8 elements
    bf16 = _flat_new(tmp_path, capsys, {**FSDP1_LLAMA, "dtype": "bfloat16"}, "fsdp1", "ORIG=1", "AT=3")
    assert "\nmesh fsdp (dp=1) at 3\n" in bf16 and " align 8 pad dp over dp] bf16\n" in bf16
    path, config = tmp_path / "fsdp1.layout", tmp_path / "config.json"
    config.write_text(json.dumps(FSDP1_LLAMA))
    assert main(["new", "fsdp1", "--config", str(config), "--set", "DP=2", "-o", str(path)]) == 0
    assert capsys.readouterr().out == (f"wrote {path}: llama in the fsdp1 convention, 3 tensor instances on ranks 0..1 "
                                       "(DP=2, AT=0, ORIG=0; numbers in the text: regenerate with --set DP=...)\n")


@pytest.mark.parametrize("family", CONFIGS)
def test_registration_order_is_named_parameters_of_each_family(family):
    """The order the flat trainers list parameters in is transformers' own: named_parameters() of a
    model of the config, built on the meta device (DeepSeek-V3's e_score_correction_bias is a buffer)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from layoutlang.bridges.families import model_from_config
    from layoutlang.bridges.flat_layout import registration_order

    cfg = dict(CONFIGS[family])
    conf = transformers.CONFIG_MAPPING[cfg.pop("model_type")](**cfg)
    with torch.device("meta"):
        names = [n for n, _ in transformers.AutoModelForCausalLM.from_config(conf).named_parameters()]
    memory = loads(render_new(CONFIGS[family], "hf-memory", {}), "memory").tensors
    ours = [t.name for t in registration_order(model_from_config(CONFIGS[family]), memory)]
    assert [n for n in ours if n in names] == names


def test_flat_trainers_refuse_what_their_bridges_refuse_and_args_they_lack(tmp_path, capsys, config_files):
    code, err = _run(["new", "deepspeed", "--config", str(config_files["llama"]), "--set", "TP=2"], capsys)
    assert code == 2 and err == "error: --set TP=2: the deepspeed layout of llama has no arg TP\nhelp: its args: DP, AT\n"
    code, err = _run(["new", "deepspeed", "--config", str(config_files["llama"]), "--set", "ORIG=1"], capsys)
    assert code == 2 and err.startswith("error: --set ORIG=1: the deepspeed layout of llama has no arg ORIG\n")
    code, err = _run(["new", "fsdp1", "--config", str(config_files["llama"]), "--set", "ORIG=2"], capsys)
    assert code == 2 and err == "error: --set ORIG=2: expected 1 (use_orig_params=True) or 0 (False)\n"
    code, err = _run(["new", "fsdp1", "--config", str(config_files["qwen3_moe"])], capsys)
    assert code == 2 and err.startswith("error: qwen3_moe: transformers stacks each layer's experts")
    code, err = _run(["new", "deepspeed", "--config", str(config_files["deepseek_v3"])], capsys)
    assert code == 2 and err.startswith("error: deepseek_v3: `mlp.gate.e_score_correction_bias` is a buffer")
    code, err = _run(["new", "deepspeed", "--config", str(config_files["gpt_oss"])], capsys)
    assert code == 2 and err.startswith("error: parameter `model.layers.0.mlp.experts.gate_up_proj` stores its keys")
    path = tmp_path / "bert.json"
    path.write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    code, err = _run(["new", "fsdp1", "--config", str(path)], capsys)
    assert code == 2 and err.startswith(f"error: {path}: model_type `bert` is not a family `layoutc new` knows\n")
