"""Megatron's uneven pipeline split in `layoutc new megatron` (issue 49, item 5).

The reference is the installed megatron-core itself: `TransformerConfig` (its
`__post_init__` checks the split args), `get_num_layers_to_build` /
`get_transformer_layer_offset` (called with an explicit `pp_rank`: pure, no
process group) and, for `pipeline_model_parallel_layout`, the parsed
`PipelineParallelLayerLayout`'s own per-rank counts and offsets. Every split
`layoutlang.bridges.megatron_split` accepts must be one megatron-core accepts,
with the same layers on every stage, and every one it refuses one megatron-core
refuses (or would build a stage of fewer than zero layers from).
"""

from __future__ import annotations

import itertools
import json
import re
import warnings
from pathlib import Path

import pytest

from layoutlang import compile_plan, load
from layoutlang.bridges.megatron_split import FIRST, LAST, LAYOUT, LOSS, EMBEDDING, pipeline_split
from layoutlang.cli import main
from layoutlang.diagnostics import UsageError

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

# DeepSeek-V3's config.json (the fields `layoutc new` reads; deepseek-ai/DeepSeek-V3)
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
               "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1,
               "vocab_size": 129280, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

# Megatron-LM's flag -> TransformerConfig field
FIELDS = {FIRST: "num_layers_in_first_pipeline_stage", LAST: "num_layers_in_last_pipeline_stage",
          EMBEDDING: EMBEDDING, LOSS: LOSS, LAYOUT: LAYOUT}


def megatron_stages(layers: int, pp: int, options: dict) -> tuple[tuple[int, int], ...] | None:
    """(offset, layers) per stage as megatron-core computes them; None where it refuses the split
    (an error, or a stage of fewer than zero layers)."""
    kwargs = {FIELDS[k]: v for k, v in options.items()}
    layout = options.get(LAYOUT)
    mtp = layout.count("m") if isinstance(layout, str) else sum(s.count("mtp") for s in layout or [])
    if mtp:   # Megatron checks a layout's MTP layers against the model's
        kwargs["mtp_num_layers"] = mtp
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1,
                                       pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, **kwargs)
            layout = config.pipeline_model_parallel_layout
            if layout is not None:   # the block's helpers read the rank from parallel_state here: ask the layout
                if config.virtual_pipeline_model_parallel_size:
                    return None
                out = tuple((layout.get_layer_offset(pp_rank=r), layout.get_num_layers_to_build(pp_rank=r))
                            for r in range(pp))
            else:
                out = tuple((get_transformer_layer_offset(config, None, r), get_num_layers_to_build(config, None, r))
                            for r in range(pp))
    except (ValueError, AssertionError, KeyError, NotImplementedError):
        return None
    return None if any(n < 0 for _, n in out) else out


def ours(layers: int, pp: int, options: dict) -> tuple[tuple[int, int], ...] | None:
    try:
        split = pipeline_split(layers, pp, options)
    except UsageError:
        return None
    return tuple(zip(split.offsets, split.stages))


def _cases():
    """Every first/last and embedding/loss combination on 1..12 layers over 2..5 stages."""
    for layers, pp in itertools.product(range(1, 13), range(2, 6)):
        yield layers, pp, {}
        for first, last in itertools.product([None, *range(1, layers + 1)], repeat=2):
            if first or last:
                yield layers, pp, {k: v for k, v in ((FIRST, first), (LAST, last)) if v is not None}
        for embedding, loss in ((True, False), (False, True), (True, True)):
            yield layers, pp, {k: True for k, on in ((EMBEDDING, embedding), (LOSS, loss)) if on}
        yield layers, pp, {FIRST: 1, EMBEDDING: True}                  # refused together


def test_first_last_and_accounting_splits_are_megatron_cores():
    compared = accepted = 0
    for layers, pp, options in _cases():
        expected = megatron_stages(layers, pp, options)
        got = ours(layers, pp, options)
        if not options and expected is None:   # no split arg where PP does not divide: layoutc picks one
            assert got is None or pipeline_split(layers, pp, {}).chosen, (layers, pp)
            if got is not None:
                flags = pipeline_split(layers, pp, {}).flags
                picked = {FIRST if "first" in f else LAST: int(f.split()[1]) for f in flags}
                assert megatron_stages(layers, pp, picked) == got, (layers, pp, picked)
            continue
        assert got == expected, (layers, pp, options)
        compared += 1
        accepted += expected is not None
    assert compared > 3000 and accepted > 500    # the grid covers both outcomes


def _layout_strings(layers: int, pp: int):
    """Every one-stage-per-rank layout of `layers` decoder layers: E first, L last, an MTP layer or not."""
    for cut in itertools.combinations(range(layers + 1), pp - 1):
        bounds = (0, *cut, layers)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        if any(c < 0 for c in counts):
            continue
        for mtp in ("", "m"):
            stages = ["t" * c for c in counts]
            stages[0] = "E" + stages[0]
            stages[-1] += mtp + "L"
            yield "|".join(stages)


def test_pipeline_model_parallel_layouts_are_megatron_cores():
    n = 0
    for layers, pp in itertools.product(range(1, 7), range(2, 4)):
        for text in _layout_strings(layers, pp):
            assert ours(layers, pp, {LAYOUT: text}) == megatron_stages(layers, pp, {LAYOUT: text}), text
            n += 1
    # repeats, commas and the list form, as Megatron's parser reads them; and layouts it refuses
    for text, layers, pp in (("Et*3|(tt|)*2,t*2L", 9, 4), ("E|t*5|tL", 6, 3), ("Ettt|ttL", 6, 2),
                             ("tE|ttL", 3, 2), ("Et|tt", 3, 2), ("Et|ttL", 4, 2), ("Et|tLL", 2, 2),
                             ("Et|mtL", 2, 2), ("Et|t|tL", 3, 2), ("Et|tx|L", 2, 3),
                             ([["embedding", "decoder"], ["decoder", "loss"]], 2, 2),
                             ([["embedding", "decoder"], ["decoder", "mtp", "loss"]], 2, 2)):
        assert ours(layers, pp, {LAYOUT: text}) == megatron_stages(layers, pp, {LAYOUT: text}), text
        n += 1
    assert n > 100


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek")
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    return folder


@pytest.fixture(scope="module")
def vllm_tp8(deepseek):
    """`layoutc new vllm --set TP=8` of DeepSeek-V3, loaded."""
    path = deepseek / "infer.layout"
    assert main(["new", "vllm", "--config", str(deepseek / "config.json"), "--set", "TP=8", "-o", str(path)]) == 0
    return load(str(path))


def _stages_in(layout) -> dict[int, list[tuple[int, int]]]:
    """Per pp coordinate, (global layer, stage-local number) of every decoder tensor it holds, read from
    the elaborated layout: the NAME's number and the key's."""
    mesh = layout.meshes[0]
    pp_axis = [a.name for a in mesh.axes].index("pp")
    out: dict[int, set] = {}
    for t in layout.tensors:
        local = re.match(r"decoder\.layers\.(\d+)\.", t.name)
        if not local:
            continue
        keys = [t.key] if t.regions is None else [r.key for r in t.regions]
        (layer,) = {int(re.match(r"model\.layers\.(\d+)\.", k).group(1)) for k in keys}
        for rank in t.ranks():
            out.setdefault(mesh.coords(rank)[pp_axis], set()).add((layer, int(local.group(1))))
    return {stage: sorted(v) for stage, v in out.items()}


@pytest.mark.parametrize("pp", [4, 8, 16])
def test_deepseek_v3_trains_at_pp_4_8_16_and_plans_into_vllm_tp8(deepseek, vllm_tp8, pp, capsys, tmp_path):
    """61 layers: no PP of 4, 8 or 16 divides them. The file says the Megatron-LM flags of its split; with
    those flags megatron-core builds exactly the layers each stage holds in the file, under the same
    stage-local NAMEs; and the trainer plans into vLLM at TP8."""
    train = tmp_path / "train.layout"
    code, out, err = _run(["new", "megatron", "--config", str(deepseek / "config.json"), "--set", f"PP={pp}",
                           "-o", str(train)], capsys)
    assert code == 0, err
    if pp == 4:   # the note docs/bridges.md shows
        assert err.splitlines()[0] in (Path(__file__).parent.parent / "docs" / "bridges.md").read_text().splitlines()
    flags = re.search(r"Megatron-LM: (--[^)]*)\)", err).group(1).split(" --")
    options = {f.strip("-").split()[0].replace("-", "_"): int(f.split()[1]) for f in flags}
    assert set(options) == {FIRST, LAST} and all(k.replace("_", "-") in train.read_text() for k in options)
    expected = megatron_stages(61, pp, options)
    assert expected is not None and [n for _, n in expected] != [61 // pp] * pp
    layout = load(str(train))
    held = _stages_in(layout)
    assert sorted(held) == list(range(pp))
    for stage, (offset, count) in enumerate(expected):
        assert sorted({layer for layer, _ in held[stage]}) == list(range(offset, offset + count)), stage
        assert all(local == layer - offset for layer, local in held[stage]), stage
    assert _run(["fmt", "--check", str(train)], capsys)[0] == 0
    plan = compile_plan(layout, vllm_tp8)   # proven: every destination element written once
    assert plan.stats["bytes"] > 0 and {op.src_rank for op in plan.ops} == set(range(pp))


def test_each_split_arg_is_written_as_megatron_splits(deepseek, capsys, tmp_path):
    config = str(deepseek / "config.json")
    for sets, stages in ((["PP=4", f"{FIRST}=16"], [16, 15, 15, 15]),
                         (["PP=4", f"{LAST}=13"], [16, 16, 16, 13]),
                         (["PP=3", f"{EMBEDDING}=true", f"{LOSS}=1"], [20, 21, 20]),
                         (["PP=4", f"{LAYOUT}=Et*15|t*16|t*16|t*14mL"], [15, 16, 16, 14])):
        path = tmp_path / "t.layout"
        argv = ["new", "megatron", "--config", config, "-o", str(path)]
        code, out, err = _run(argv + [x for s in sets for x in ("--set", s)], capsys)
        assert code == 0 and err == "", err
        assert "pipeline stages of " + "/".join(map(str, stages)) + " layers" in out
        assert f"sizes [{', '.join(map(str, stages))}]" in path.read_text()
        assert "const PP = " in path.read_text() and "arg PP" not in path.read_text()


@pytest.mark.parametrize("sets,message,help_", [
    (["PP=4", f"{FIRST}=10", f"{LAST}=10"],
     f"error: --set {FIRST}=10 and {LAST}=10: 61 layers over PP=4 leave 41 layers for the 2 stage(s) between; "
     "Megatron needs the stages between to hold an equal share (at least one layer)",
     f"help: choose values that leave a multiple of 2 layers, e.g. --set {FIRST}=15 --set {LAST}=14"),
    (["PP=4", f"{EMBEDDING}=1"],
     f"error: --set {EMBEDDING}: 61 layers + 1 counted for the embedding = 62, which PP=4 does not divide "
     "(Megatron requires it)", None),
    (["PP=4", f"{LAYOUT}=Et*3|(tt|)*29,m|L"],
     f"error: --set {LAYOUT}=Et*3|(tt|)*29,m|L: 32 stages over PP=4 make 8 virtual pipeline stages per rank, "
     "which `layoutc new megatron` does not describe", "help: write one stage per pipeline rank (4 stages)"),
    (["PP=4", f"{FIRST}=15", f"{EMBEDDING}=1"],
     f"error: --set {FIRST} cannot be combined with {EMBEDDING} (Megatron refuses the pair)",
     "help: use either the first/last stage sizes or the embedding/loss accounting"),
    (["PP=64"],
     "error: PP=64 does not divide the 61 layers, and 64 stages are too many for the first/last split layoutc "
     "picks otherwise (each stage needs at least one layer)",
     f"help: choose a smaller PP, or write the split with --set {LAYOUT}=..."),
])
def test_a_split_megatron_refuses_is_a_usage_error_naming_the_args(deepseek, capsys, sets, message, help_):
    """No file position (the text was never written) and no edit of generated code: the --set args."""
    argv = ["new", "megatron", "--config", str(deepseek / "config.json")]
    code, out, err = _run(argv + [x for s in sets for x in ("--set", s)], capsys)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0] == message
    if help_ is not None:
        assert lines[1] == help_
    assert "layoutc new megatron>" not in err and "edit" not in err
