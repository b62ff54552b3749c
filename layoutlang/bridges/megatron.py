"""The `.layout` of a live Megatron-Core trainer: `describe(model)` and `tensors(model)`.

`describe` returns the text of the WHOLE trainer (every rank's weights), the
same on every rank, computed from three things the trainer already holds:

- `megatron.core.parallel_state`: the sizes of TP, PP, DP, CP, EP, expert-TP
  and expert-DP and, from each of this rank's groups, the stride of every axis
  in the global rank numbering. Megatron numbers ranks mixed-radix in its
  `order` (default "tp-cp-ep-dp-pp": tp fastest); a `.layout` mesh is row-major
  (last axis fastest), so the mesh lists the axes by decreasing stride:
  `mesh train (pp, dp, cp, tp)` for the dense weights and
  `mesh experts (pp, edp, ep, etp) at 0` for the experts, each mapping
  coordinates to exactly the ranks Megatron gives them.
- the model's `config` (TransformerConfig: heads, query groups, head size,
  FFN sizes, experts) and its pipeline split (each stage's layer offset and
  count, as Megatron computes them: even, uneven first/last stages, embedding /
  loss accounting or a pipeline_model_parallel_layout of one stage per rank;
  unequal stages are written `over pp sizes [...]`): the logical extents and
  part structure.
- the live parameters: their names and the attributes Megatron sets on them
  (`tensor_model_parallel`, `partition_dim`, `partition_stride`, `allreduce`
  False for experts under EP) say which dim is split over which axis; their
  shapes and dtypes are checked against the elaborated layout before it is
  returned. Each kind of layer (dense, MoE) is read from this rank's own
  layers; other stages' layers of that kind are written the same way. A kind
  this stage does not hold (DeepSeek-V3 under PP: its dense layers all on
  stage 0) is derived from one it does, with the local spec's MLP for that
  kind (`_derived_template`). The router's `expert_bias` buffer is a weight
  too (the engine routes with it).

Keys follow the HF-name convention (LANGUAGE.md 8): the HF checkpoint name of
each unfused, per-expert weight. Fused QKV carries part keys grouped per query
group (`(KV, (q: (QG, (re: D/2 | im: D/2)) as q_proj | k: (re: D/2 | im: D/2) as k_proj | v: D as
v_proj)) over tp`: q/k rows as each head's rotary halves, as every convention writes them;
Meta's interleaved pairs with `rotary_interleaved`),
fc1 carries `(gate: F as gate_proj | up: F as up_proj) over tp` (each TP rank
holds its slice of gate, then of up), and an expert's local index restarts at
0 on every EP rank while its key carries the global expert id
(`for e in 0..E over ep`, `...local_experts.{e.local}...` as `experts.{e}`).

Multi-latent attention (DeepSeek-V3; megatron-core 0.19 builds it with the local
spec once `core_attention` is a module that takes MLA's `k_channels` /
`v_channels`, such as one calling torch's SDPA) keys to DeepSeek-V3's HF names:
`linear_q_down_proj` (q_a_proj), `linear_q_up_proj` (q_b_proj) or, without q
LoRA, `linear_q_proj` (q_proj), `linear_kv_down_proj` (kv_a_proj_with_mqa),
`linear_kv_up_proj` (kv_b_proj), `q_layernorm` / `kv_layernorm` (q_a_layernorm /
kv_a_layernorm) and `linear_proj` (o_proj). The local spec splits every
projection on dim 0 over tp, the down projections included:
`[KV_LORA + QK_ROPE over tp, H]` cuts the kv_lora rows and the rope rows as one
extent, exactly as Megatron stores them (a rank may hold latent rows and rope
rows). The up projections split whole heads: `[(NH, QK_NOPE + V_HEAD) over tp,
KV_LORA]`. The Transformer Engine spec instead keeps the down projections whole
on every TP rank (`tensor_model_parallel` False: no `over`) and fuses the LoRA
norms into the up projections (`linear_q_up_proj.layer_norm_weight`).
`moe_grouped_gemm=True` with the local spec builds SequentialMLP experts
(`local_experts.{i}`), described as above; TE's grouped GEMM stores
`linear_fc1.weight{i}`, one tensor per expert too.

>>> from layoutlang.bridges import megatron  # doctest: +SKIP
>>> text = megatron.describe(gpt_model, vocab_size=hf_config.vocab_size)  # doctest: +SKIP
>>> plan = layoutlang.compile_plan(layoutlang.loads(text), engine_layout)  # doctest: +SKIP
>>> Refitter(plan).refit(megatron.tensors(gpt_model), engine_tensors)  # doctest: +SKIP

Not described (a BridgeError naming the parameter): MLA's fused down projection
(`linear_qkv_down_proj`, TE's mla_down_proj_fusion), legacy GroupedMLP,
multi-token prediction, virtual pipeline stages (a
pipeline_model_parallel_layout of more than one stage per rank included),
parameters of modules the bridge does not know. megatron-core is imported lazily, inside the calls that need it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from layoutlang.diagnostics import did_you_mean

from .families import BridgeError  # the bridges' one error type

__all__ = ["FAMILIES", "BridgeError", "describe", "tensors"]


# ---------------------------------------------------------------------------
# Keys: the HF checkpoint names of the unfused weights, per model family.

# role -> HF module path inside `model.layers.{l}` (the `.weight`/`.bias` is appended)
_LLAMA = {
    "attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
    "v": "self_attn.v_proj", "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm", "mlp_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
    "router": "mlp.gate", "expert_gate": "mlp.experts.{e}.gate_proj",
    "expert_up": "mlp.experts.{e}.up_proj", "expert_down": "mlp.experts.{e}.down_proj",
    "shared_gate": "mlp.shared_expert.gate_proj", "shared_up": "mlp.shared_expert.up_proj",
    "shared_down": "mlp.shared_expert.down_proj", "shared_expert_gate": "mlp.shared_expert_gate",
}
_DEEPSEEK = {**_LLAMA, "shared_gate": "mlp.shared_experts.gate_proj",
             "shared_up": "mlp.shared_experts.up_proj", "shared_down": "mlp.shared_experts.down_proj",
             # multi-latent attention (q_a/q_b with q LoRA, else the plain q_proj of `q`)
             "q_a": "self_attn.q_a_proj", "q_a_norm": "self_attn.q_a_layernorm", "q_b": "self_attn.q_b_proj",
             "kv_a": "self_attn.kv_a_proj_with_mqa", "kv_a_norm": "self_attn.kv_a_layernorm",
             "kv_b": "self_attn.kv_b_proj"}
_MIXTRAL = {**_LLAMA, "router": "block_sparse_moe.gate",
            "expert_gate": "block_sparse_moe.experts.{e}.w1",
            "expert_up": "block_sparse_moe.experts.{e}.w3",
            "expert_down": "block_sparse_moe.experts.{e}.w2"}

FAMILIES = {  # HF model_type -> its checkpoint names
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
    "qwen2_moe": _LLAMA, "qwen3_moe": _LLAMA, "olmoe": _LLAMA,
    "deepseek_v3": _DEEPSEEK, "mixtral": _MIXTRAL,
}


def _family(config, family: str | None) -> dict[str, str]:
    mla = bool(getattr(config, "multi_latent_attention", False))
    if family is None:  # what the config can tell apart; pass family= where it cannot
        if mla:
            family = "deepseek_v3"
        elif not config.num_moe_experts:
            family = "llama"
        elif getattr(config, "moe_shared_expert_intermediate_size", None):
            family = "qwen2_moe" if getattr(config, "moe_shared_expert_gate", False) else "deepseek_v3"
        elif config.qk_layernorm:
            family = "qwen3_moe"
        else:
            family = "mixtral"
    if family not in FAMILIES:
        raise BridgeError(f"unknown model family `{family}`: expected one of {', '.join(sorted(FAMILIES))}",
                          help=did_you_mean(family, FAMILIES))
    if mla and "kv_a" not in FAMILIES[family]:
        mla_families = sorted(f for f, k in FAMILIES.items() if "kv_a" in k)
        raise BridgeError(f"family `{family}` has no HF names for multi-latent attention "
                          "(config.multi_latent_attention is True)",
                          help=f"MLA keys are DeepSeek-V3's: pass family= one of {', '.join(mla_families)}")
    return FAMILIES[family]


# ---------------------------------------------------------------------------
# Parallel state: the axes and their place in the global rank numbering.

@dataclass(frozen=True)
class Group:
    """One parallel axis as this rank sees it: its size and the global ranks of its group."""

    name: str
    size: int
    ranks: tuple[int, ...]   # this rank's group, in group order (coordinate 0 first)


@dataclass(frozen=True)
class MeshAxes:
    """A mesh's axes, major first, with this rank's coordinate on each."""

    axes: tuple[tuple[str, int], ...]
    coords: tuple[int, ...]

    def text(self, name: str, at: bool = False) -> str:
        body = ", ".join(f"{n}={s}" for n, s in self.axes)
        return f"mesh {name} ({body})" + (" at 0" if at else "")


def mesh_axes(groups: Sequence[Group], rank: int, world: int) -> MeshAxes:
    """The row-major mesh whose coordinates number the ranks as the groups do.

    Megatron numbers ranks mixed-radix: along each axis the members of a group
    are `stride` apart, the fastest axis has stride 1 and each next one the
    product of the sizes before it. The mesh lists the axes by decreasing
    stride (last fastest). Axes of size 1 keep the order `groups` gives them.
    Raises BridgeError when the groups are not such a numbering.

    >>> g = [Group("pp", 2, (1, 5)), Group("dp", 2, (1, 3)), Group("tp", 2, (0, 1))]
    >>> mesh_axes(g, 1, 8)
    MeshAxes(axes=(('pp', 2), ('dp', 2), ('tp', 2)), coords=(0, 0, 1))
    """
    strides = {}
    for g in groups:
        if len(g.ranks) != g.size or rank not in g.ranks:
            raise BridgeError(f"the {g.name} group of rank {rank} is {list(g.ranks)}: expected {g.size} ranks "
                              f"including rank {rank}")
        if g.size > 1:
            step = g.ranks[1] - g.ranks[0]
            if step <= 0 or any(b - a != step for a, b in zip(g.ranks, g.ranks[1:])):
                raise BridgeError(f"the {g.name} group of rank {rank} is {list(g.ranks)}: its ranks are not "
                                  "evenly spaced, so no mesh numbers them",
                                  help="Megatron's RankGenerator (initialize_model_parallel) numbers ranks "
                                       "this way; describe() expects its groups")
            strides[g.name] = step
    big = sorted((g for g in groups if g.size > 1), key=lambda g: strides[g.name])
    expected = 1
    for g in big:
        if strides[g.name] != expected:
            raise BridgeError(f"axis {g.name} (size {g.size}) has stride {strides[g.name]} in the rank numbering; "
                              f"a row-major mesh of {', '.join(f'{x.name}={x.size}' for x in big)} needs {expected}")
        expected *= g.size
    if expected != world:
        raise BridgeError(f"the parallel axes cover {expected} ranks but the process group has {world}",
                          help="describe() needs Megatron to span the whole default process group")
    order = [g.name for g in reversed(big)]               # major first
    canonical = [g.name for g in groups]
    for g in groups:                                      # size-1 axes where `groups` lists them
        if g.size == 1:
            i = canonical.index(g.name)
            later = [k for k, n in enumerate(order) if n in canonical and canonical.index(n) > i]
            order.insert(later[0] if later else len(order), g.name)
    by_name = {g.name: g for g in groups}
    return MeshAxes(tuple((n, by_name[n].size) for n in order),
                    tuple(by_name[n].ranks.index(rank) for n in order))


def _groups(ps) -> tuple[list[Group], list[Group] | None]:
    """The dense and expert axes of this rank from megatron.core.parallel_state."""
    import torch.distributed as dist

    def group(name, pg, size):
        ranks = tuple(dist.get_process_group_ranks(pg)) if size > 1 else (dist.get_rank(),)
        return Group(name, size, ranks)

    dense = [group("pp", ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()),
             group("dp", ps.get_data_parallel_group(), ps.get_data_parallel_world_size())]
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        dense.append(group("cp", ps.get_context_parallel_group(), cp))
    dense.append(group("tp", ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()))
    expert = [group("pp", ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()),
              group("edp", ps.get_expert_data_parallel_group(), ps.get_expert_data_parallel_world_size()),
              group("ep", ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()),
              group("etp", ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size())]
    return dense, expert


# ---------------------------------------------------------------------------
# Roles: what a Megatron parameter is, as dims of the logical (HF) tensor.

@dataclass(frozen=True)
class Role:
    """A parameter's dims (unsplit modes), the dim Megatron splits, and its key(s).

    `dims` are mode texts over the constants of the described layout; part keys
    sit inside them. `key` is the tensor's key when it has no part keys. `split`
    is the dim Megatron splits over TP (expert TP for experts), `parts` the
    number of parts of that dim's concatenation (the largest partition_stride
    it can hold). `replicable`: a spec may instead keep it whole on every TP
    rank (MLA's down projections: split by the local spec, duplicated by TE's),
    which the parameter's `tensor_model_parallel` attribute then says.
    """

    dims: tuple[str, ...]
    key: str | None
    split: int | None
    expert: bool = False
    parts: int = 1
    replicable: bool = False


_NORM = re.compile(r"(?:(input_layernorm\.|self_attention\.linear_qkv\.layer_norm_)"
                   r"|(pre_mlp_layernorm\.|mlp\.linear_fc1\.layer_norm_))(weight|bias)")


# One head's q/k rows (model.py `rotary_rows`, LANGUAGE.md 3): Megatron's rotary rotates
# halves as HF does (re rows, then im rows), or, with `rotary_interleaved`, adjacent pairs as Meta.
ROTARY_HEAD = {False: "(re: D/2 | im: D/2)", True: "(D/2, (re: 1 | im: 1))"}


def _layer_role(rel: str, keys: dict[str, str], gated: bool, mla: bool = False,
                interleaved: bool = False) -> Role | None:
    """The role of `decoder.layers.N.<rel>` (experts' local index written `{e}`); None if unknown.

    `mla`: the layer's attention is multi-latent (`_mla_role`), not grouped-query.
    `interleaved`: the config's `rotary_interleaved` (q/k rows in Meta's order, `ROTARY_HEAD`).
    """
    pre = "model.layers.{l}."
    m = _NORM.fullmatch(rel)
    if m:
        return Role(("H",), pre + keys["attn_norm" if m.group(1) else "mlp_norm"] + "." + m.group(3), None)
    if mla and rel.startswith("self_attention."):
        return _mla_role(rel[len("self_attention."):], pre, keys)
    m = re.fullmatch(r"self_attention\.linear_qkv\.(weight|bias)", rel)
    if m:
        w = m.group(1)
        head = ROTARY_HEAD[interleaved]
        qkv = (f"(KV, (q: (QG, {head}) as {pre}{keys['q']}.{w} | k: {head} as {pre}{keys['k']}.{w} "
               f"| v: D as {pre}{keys['v']}.{w}))")
        return Role((qkv, "H") if w == "weight" else (qkv,), None, 0)
    if rel == "self_attention.linear_proj.weight":
        return Role(("H", "Q*D"), pre + keys["o"] + ".weight", 1)
    if rel == "self_attention.linear_proj.bias":
        return Role(("H",), pre + keys["o"] + ".bias", None)
    m = re.fullmatch(r"self_attention\.(q|k)_layernorm\.(weight|bias)", rel)
    if m:
        return Role(("D",), pre + keys[m.group(1) + "_norm"] + "." + m.group(2), None)
    if rel == "mlp.router.weight":
        return Role(("E", "H"), pre + keys["router"] + ".weight", None)
    if rel == "mlp.router.bias":
        return Role(("E",), pre + keys["router"] + ".bias", None)
    if rel == "mlp.router.expert_bias":   # a buffer (aux-loss-free balancing), the engine routes with it
        return Role(("E",), pre + keys["router"] + ".e_score_correction_bias", None)
    if rel == "mlp.shared_experts.gate_weight":
        return Role(("1", "H"), pre + keys["shared_expert_gate"] + ".weight", None)
    for prefix, ext, kind, expert in (("mlp.", "F", "", False), ("mlp.shared_experts.", "FS", "shared_", False),
                                      ("mlp.experts.local_experts.{e}.", "I", "expert_", True)):
        if not rel.startswith(prefix):
            continue
        m = re.fullmatch(r"linear_fc(1|2)\.(weight|bias)", rel[len(prefix):])
        if not m:
            continue
        return _mlp_role(m.group(1), m.group(2), ext, kind, expert, pre, keys, gated)
    m = re.fullmatch(r"mlp\.experts\.linear_fc(1|2)\.(weight|bias)\{e\}", rel)   # TE grouped GEMM
    if m:
        return _mlp_role(m.group(1), m.group(2), "I", "expert_", True, pre, keys, gated)
    return None


# MLA projections: Megatron module -> (HF role, rows, columns, may a spec keep it whole on every TP rank).
# Rows of the up projections are per head (nope then rope for q, nope then v for kv), as HF stores them.
_MLA_LINEAR = {
    "linear_q_down_proj": ("q_a", "Q_LORA", "H", True),
    "linear_q_up_proj": ("q_b", "(NH, QK_NOPE + QK_ROPE)", "Q_LORA", False),
    "linear_q_proj": ("q", "(NH, QK_NOPE + QK_ROPE)", "H", False),
    "linear_kv_down_proj": ("kv_a", "KV_LORA + QK_ROPE", "H", True),
    "linear_kv_up_proj": ("kv_b", "(NH, QK_NOPE + V_HEAD)", "KV_LORA", False),
}
# The LoRA norms: the local spec's own modules, or TE's norm fused into the up projection.
_MLA_NORM = re.compile(r"(?:(q_layernorm\.|linear_q_up_proj\.layer_norm_)"
                       r"|(kv_layernorm\.|linear_kv_up_proj\.layer_norm_))(weight|bias)")


def _mla_role(rel: str, pre: str, keys: dict[str, str]) -> Role | None:
    """The role of `self_attention.<rel>` in a multi-latent attention layer; None if unknown.

    The kv down projection's rows are the latent (KV_LORA) then the shared rope key
    (QK_ROPE); the local spec splits them as ONE extent over tp, so the layout writes
    the plain sum (HF's kv_a_proj_with_mqa is one key of that extent, no parts).
    """
    m = _MLA_NORM.fullmatch(rel)
    if m:
        which, extent = ("q_a_norm", "Q_LORA") if m.group(1) else ("kv_a_norm", "KV_LORA")
        return Role((extent,), f"{pre}{keys[which]}.{m.group(3)}", None)
    m = re.fullmatch(r"(linear_\w+)\.weight", rel)
    if m and m.group(1) in _MLA_LINEAR:
        role, rows, cols, replicable = _MLA_LINEAR[m.group(1)]
        return Role((rows, cols), f"{pre}{keys[role]}.weight", 0, replicable=replicable)
    if rel == "linear_proj.weight":
        return Role(("H", "NH*V_HEAD"), pre + keys["o"] + ".weight", 1)
    if rel == "linear_proj.bias":
        return Role(("H",), pre + keys["o"] + ".bias", None)
    return None


def _mlp_role(fc: str, w: str, ext: str, kind: str, expert: bool, pre: str, keys: dict, gated: bool) -> Role:
    if fc == "1":
        if gated:
            mode = f"(gate: {ext} as {pre}{keys[kind + 'gate']}.{w} | up: {ext} as {pre}{keys[kind + 'up']}.{w})"
            return Role((mode, "H") if w == "weight" else (mode,), None, 0, expert, parts=2)
        return Role((ext, "H") if w == "weight" else (ext,), f"{pre}{keys[kind + 'up']}.{w}", 0, expert)
    if w == "weight":
        return Role(("H", ext), f"{pre}{keys[kind + 'down']}.weight", 1, expert)
    return Role(("H",), f"{pre}{keys[kind + 'down']}.bias", None, expert)


_UNSUPPORTED = (
    (r"mlp\.experts\.weight[12]",
     ("legacy GroupedMLP stores every local expert inside one dim of `weight1`/`weight2` (experts "
      "concatenated along the FFN dim, transposed), which a `.layout` dim cannot key per expert"),
     ("build the experts with moe_grouped_gemm=False (SequentialMLP) or Transformer Engine's grouped GEMM "
      "(TEGroupedMLP, one `linear_fc1.weight{i}` per expert)")),
    (r"self_attention\.linear_qkv_down_proj\..*",
     ("MLA's fused q/kv down projection (Transformer Engine's mla_down_proj_fusion, FusedMLASelfAttention) "
      "is not described: it needs Transformer Engine, so no live model checks its rows and norm"),
     "build the model with mla_down_proj_fusion=False (separate linear_q_down_proj / linear_kv_down_proj)"),
    (r"self_attention\.linear_(q|kv)_(down|up)_proj.*|self_attention\.linear_q_proj.*"
     r"|self_attention\.(q|kv)_layernorm.*",
     "a multi-latent attention parameter the bridge does not know (or config.multi_latent_attention is False)",
     "described: the local spec's and Transformer Engine's unfused MLA (see layoutlang/bridges/megatron.py)"),
)


# ---------------------------------------------------------------------------
# The model: its parameters grouped by layer.

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\..+)")
_GROUPED_EXPERT = re.compile(r"(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)")
_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def _unwrap(model):
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise BridgeError(f"a list of {len(model)} model chunks (virtual pipeline stages) is not supported",
                              help="describe the model of a run without virtual pipeline parallelism")
        model = model[0]
    while not hasattr(model, "decoder") and hasattr(model, "module"):   # DDP, Float16Module
        model = model.module
    if not hasattr(model, "decoder") or not hasattr(model, "config"):
        raise BridgeError(f"{type(model).__name__} is not a Megatron-Core GPTModel (no `decoder`/`config`)")
    return model


# Buffers that are weights: an engine needs them to compute what the trainer computes.
_WEIGHT_BUFFERS = re.compile(r"decoder\.layers\.\d+\.mlp\.router\.expert_bias")


def _weights(model) -> dict:
    """Every parameter, and the buffers that are weights (`_WEIGHT_BUFFERS`), by local name."""
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if _WEIGHT_BUFFERS.fullmatch(n))
    return out


def _dtype(name: str, p) -> str:
    d = _DTYPES.get(str(p.dtype))
    if d is None:
        raise BridgeError(f"parameter `{name}` has dtype {p.dtype}: a Megatron bridge layout holds "
                          f"{', '.join(_DTYPES.values())}")
    return d


def _abstract(rel: str) -> tuple[str, int | None]:
    """`mlp.experts.local_experts.3.linear_fc1.weight` -> (`mlp.experts.local_experts.{e}.linear_fc1.weight`, 3)."""
    m = _LOCAL_EXPERT.fullmatch(rel)
    if m:
        return m.group(1) + "{e}" + m.group(3), int(m.group(2))
    m = _GROUPED_EXPERT.fullmatch(rel)
    if m:
        return m.group(1) + "{e}", int(m.group(2))
    return rel, None


def _megatron_name(rel: str) -> str:
    """The layout NAME of an abstract layer-relative name (the local expert index is `{e.local}`)."""
    return rel.replace("{e}", "{e.local}")


@dataclass(frozen=True)
class _Param:
    rel: str          # abstract name inside its layer (or the full name outside layers)
    role: Role
    dtype: str
    split: int | None  # the dim split over tp/etp, from the parameter's attributes


def _check_attributes(name: str, p, role: Role, tp: int, etp: int, ep: int) -> int | None:
    """The dim the parameter's attributes split; errors where they contradict its role."""
    is_tp = bool(getattr(p, "tensor_model_parallel", False))
    allreduce = getattr(p, "allreduce", True)
    # Megatron: allreduce = not (is_expert and expert_model_parallel_size > 1)
    if role.expert and ep > 1 and allreduce is not False:
        raise BridgeError(f"parameter `{name}` is an expert weight but its `allreduce` attribute is {allreduce!r} "
                          f"(Megatron marks expert weights allreduce=False when ep={ep} > 1)")
    if not role.expert and allreduce is False:
        raise BridgeError(f"parameter `{name}` is marked expert-parallel (allreduce=False) but is not an expert "
                          "weight; the bridge cannot place it on the expert mesh")
    if not is_tp:
        size = etp if role.expert else tp
        if role.split is not None and size > 1 and not role.replicable:
            raise BridgeError(f"parameter `{name}` is not marked tensor-parallel, but Megatron splits its dim "
                              f"{role.split} over {'etp' if role.expert else 'tp'}={size}")
        return None
    dim = getattr(p, "partition_dim", None)
    stride = getattr(p, "partition_stride", 1)
    if role.split is None or dim != role.split:
        raise BridgeError(f"parameter `{name}` is tensor-parallel on dim {dim} (partition_dim); the bridge knows "
                          f"it split on {'no dim' if role.split is None else f'dim {role.split}'}")
    if stride not in (1, role.parts):
        raise BridgeError(f"parameter `{name}` has partition_stride {stride} on dim {dim}: the dim "
                          f"`{role.dims[dim]}` has {role.parts} part(s), so a stride of {stride} cannot be expressed")
    return dim


def _role_or_error(name: str, rel: str, keys, gated: bool, mla: bool, interleaved: bool = False) -> Role:
    role = _layer_role(rel, keys, gated, mla, interleaved)
    if role is not None:
        return role
    for pattern, what, help_ in _UNSUPPORTED:
        if re.fullmatch(pattern, rel.replace("{e}", "")):
            raise BridgeError(f"parameter `{name}`: {what}", help=help_)
    raise BridgeError(f"parameter `{name}`: no HF key is known for `{rel}` (a Megatron layer parameter this "
                      "bridge does not describe)",
                      help="supported: the GPT/Llama/Qwen/Mixtral layer parameters of the local and "
                           "Transformer Engine specs (see layoutlang/bridges/megatron.py)")


# ---------------------------------------------------------------------------
# describe

def describe(model, *, vocab_size: int | None = None, name: str = "megatron", family: str | None = None) -> str:
    """The `.layout` text of the whole Megatron-Core trainer that holds `model` (same on every rank).

    `vocab_size` is the true vocabulary (the HF side's); the model holds it padded
    (`V pad K over tp`). `family` picks the HF checkpoint names (`FAMILIES`;
    by default llama for dense models; qwen2_moe, deepseek_v3, qwen3_moe or
    mixtral for MoE, as the config suggests). Raises BridgeError naming any
    parameter it cannot express. No collective: each rank computes the text alone.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = _unwrap(model)
    config = model.config
    keys = _family(config, family)
    trainer = _trainer(config, ps, dist.get_rank(), dist.get_world_size())
    weights = _weights(model)
    default = _DTYPES.get(str(config.params_dtype))
    if default is None:
        raise BridgeError(f"config.params_dtype {config.params_dtype} is not one of bf16, fp16, fp32")
    templates = _layer_templates(model, trainer, weights, keys)
    padded = model.vocab_size
    V = vocab_size if vocab_size is not None else padded
    if not 0 < V <= padded:
        raise BridgeError(f"vocab_size={V}: the model holds {padded} vocabulary rows (padded), so the true "
                          f"vocabulary must be 1..{padded}")
    vocab = "V" if V == padded else f"V pad {_pad_multiple(V, padded, trainer.tp)}"
    outside = _outside_layers(model, trainer, weights, vocab, default)
    text = _render(name, model, trainer, templates, outside, V, default)
    _check_against_model(text, weights, trainer.rank)
    return text


@dataclass(frozen=True)
class _Trainer:
    """The parallel layout describe reads before writing: meshes, sizes, stages, this rank's place."""

    rank: int
    dense: MeshAxes
    experts: MeshAxes
    stages: tuple[tuple[int, int], ...]   # (first layer, layer count) per pipeline stage
    kinds: tuple[str, ...]                # `dense` or `moe` per layer

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.dense.axes) | dict(self.experts.axes)

    tp = property(lambda self: self.sizes["tp"])
    pp = property(lambda self: self.sizes["pp"])
    ep = property(lambda self: self.sizes["ep"])
    etp = property(lambda self: self.sizes["etp"])
    pp_rank = property(lambda self: dict(zip((n for n, _ in self.dense.axes), self.dense.coords))["pp"])


def _trainer(config, ps, rank: int, world: int) -> _Trainer:
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        raise BridgeError("virtual pipeline parallelism (interleaved stages) is not supported",
                          help="describe a model built without virtual_pipeline_model_parallel_size")
    if getattr(config, "mtp_num_layers", None):
        raise BridgeError("multi-token prediction layers (mtp_num_layers) are not described by this bridge")
    dense_groups, expert_groups = _groups(ps)
    dense = mesh_axes(dense_groups, rank, world)
    return _Trainer(rank, dense, mesh_axes(expert_groups, rank, world),
                    tuple(_stages(config, dict(dense.axes)["pp"])), tuple(_layer_kinds(config)))


def _layer_templates(model, t: _Trainer, weights: dict, keys: dict[str, str]) -> dict[str, list[_Param]]:
    """One template per kind of layer (its parameters, roles, dtypes, splits), read from this rank's layers."""
    config = model.config
    E = config.num_moe_experts or 0
    offset, count = t.stages[t.pp_rank]
    layers: dict[int, dict[str, list]] = {}
    for pname, p in weights.items():
        m = _LAYER.fullmatch(pname)
        if m:
            rel, e_local = _abstract(m.group(2))
            layers.setdefault(int(m.group(1)), {}).setdefault(rel, []).append((pname, p, e_local))
    if sorted(layers) != list(range(count)):
        raise BridgeError(f"pipeline stage {t.pp_rank} holds layers {sorted(layers)}; Megatron's split of "
                          f"{config.num_layers} layers gives it {count} (layers {offset}..{offset + count - 1})")
    for local, layer in enumerate(model.decoder.layers):
        number = getattr(layer, "layer_number", offset + local + 1)
        if number != offset + local + 1:
            raise BridgeError(f"decoder.layers.{local} is layer {number} (1-based) but stage {t.pp_rank}'s "
                              f"offset is {offset}")
    templates: dict[str, list[_Param]] = {}
    for local in range(count):
        kind = t.kinds[offset + local]
        entries = []
        for rel, held in layers[local].items():
            pname = held[0][0]
            role = _role_or_error(pname, rel, keys, bool(config.gated_linear_unit),
                                  bool(getattr(config, "multi_latent_attention", False)),
                                  bool(getattr(config, "rotary_interleaved", False)))
            if role.expert:
                ids = sorted(e for _, _, e in held)
                if E % t.ep or ids != list(range(E // t.ep)):
                    raise BridgeError(f"parameter `{pname}`: layer {offset + local} holds local experts {ids}; "
                                      f"{E} experts over ep={t.ep} give each rank 0..{E // t.ep - 1}")
            dtypes = {_dtype(n, q) for n, q, _ in held}
            splits = {_check_attributes(n, q, role, t.tp, t.etp, t.ep) for n, q, _ in held}
            if len(dtypes) > 1 or len(splits) > 1:
                raise BridgeError(f"parameter `{pname}`: the local experts of layer {offset + local} differ in "
                                  f"dtype or split ({sorted(dtypes)}, {sorted(map(str, splits))})")
            entries.append(_Param(rel, role, dtypes.pop(), splits.pop()))
        has_router = any(e.rel.startswith("mlp.router.") for e in entries)
        if has_router != (kind == "moe"):
            raise BridgeError(f"decoder.layers.{local} (layer {offset + local}) "
                              f"{'has a router' if has_router else 'has no router'} but the config makes it a "
                              f"{kind} layer (num_moe_experts={config.num_moe_experts}, "
                              f"moe_layer_freq={getattr(config, 'moe_layer_freq', None)})")
        if kind not in templates:
            templates[kind] = entries
        elif [(e.rel, e.dtype, e.split) for e in templates[kind]] != [(e.rel, e.dtype, e.split) for e in entries]:
            raise BridgeError(f"decoder.layers.{local}: its parameters differ from the other {kind} layers "
                              "(heterogeneous layers of one kind are not supported)")
    for layer_index, kind in enumerate(t.kinds):
        if kind not in templates:
            derived = _derived_template(kind, next(iter(templates.values()), None), config, t, keys)
            if derived is None:
                stage = next(r for r, (o, c) in enumerate(t.stages) if o <= layer_index < o + c)
                raise BridgeError(f"layer {layer_index} is a {kind} layer on pipeline stage {stage}, and stage "
                                  f"{t.pp_rank} holds no {kind} layer to read its parameters from",
                                  help="describe() reads each kind of layer from the stage's own layers, or "
                                       "derives it from another kind where the layers are the local spec's; "
                                       "give every pipeline stage at least one layer of each kind")
            templates[kind] = derived
    # one order on every rank, whichever kinds it read and which it derived: the layer's own parameters
    # (attention, norms: one spec for both kinds) in the model's order, then its MLP's by name
    return {kind: [e for e in entries if not e.rel.startswith("mlp.")]
            + sorted((e for e in entries if e.rel.startswith("mlp.")), key=lambda e: e.rel)
            for kind, entries in templates.items()}


def _derived_template(kind: str, have: list[_Param] | None, config, t: _Trainer, keys) -> list[_Param] | None:
    """The parameters of a kind of layer this stage does not hold (DeepSeek-V3 under PP: its dense
    layers all on stage 0), from a kind it does. Megatron's decoder block spec builds both kinds
    with one layer spec function that differs only in `mlp`, so the attention and norms are the
    held kind's; the MLP is what the local spec builds for that kind from the config: fc1/fc2
    (biases with add_bias_linear) for a dense layer; for a MoE layer the router (its bias with
    add_bias_linear, its fp32 `expert_bias` buffer with moe_router_enable_expert_bias), SequentialMLP
    experts and the shared experts (their gate with moe_shared_expert_gate). In params_dtype, split
    as their roles say. None where the held layers are not the local spec's (Transformer Engine
    fuses the MLP's norm into fc1 in dense layers only) or there is no held layer to start from.
    Every rank describes every kind, so a wrong derivation is a text that differs between ranks."""
    if have is None or any("layer_norm_" in p.rel or p.rel.startswith("mlp.experts.linear_fc") for p in have):
        return None
    weights = ("weight", "bias") if config.add_bias_linear else ("weight",)
    if kind == "dense":
        rels = [f"mlp.linear_fc{i}.{w}" for i in (1, 2) for w in weights]
    else:
        rels = [f"mlp.router.{w}" for w in weights]
        if getattr(config, "moe_router_enable_expert_bias", False):
            rels.append("mlp.router.expert_bias")
        rels += [f"mlp.experts.local_experts.{{e}}.linear_fc{i}.{w}" for i in (1, 2) for w in weights]
        if getattr(config, "moe_shared_expert_intermediate_size", None):
            rels += ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"]
            if getattr(config, "moe_shared_expert_gate", False):
                rels.append("mlp.shared_experts.gate_weight")
    default = _DTYPES[str(config.params_dtype)]
    out = [p for p in have if not p.rel.startswith("mlp.")]
    for rel in rels:
        role = _role_or_error(rel, rel, keys, bool(config.gated_linear_unit),
                              bool(getattr(config, "multi_latent_attention", False)),
                              bool(getattr(config, "rotary_interleaved", False)))
        size = t.etp if role.expert else t.tp
        out.append(_Param(rel, role, "fp32" if rel.endswith(".expert_bias") else default,
                          role.split if size > 1 else None))
    return out


def _outside_layers(model, t: _Trainer, weights: dict, vocab: str, default: str) -> list[tuple[str, _Param, str]]:
    """(NAME, param, placement) of the embedding (first stage), final norm and output layer (last stage)."""
    pp = t.pp
    first, last = "at pp=0" if pp > 1 else "", "at pp=pp-1" if pp > 1 else ""
    tied = bool(model.share_embeddings_and_output_weights)
    expected = [("embedding.word_embeddings.weight", Role((vocab, "H"), "model.embed_tokens.weight", 0), first, 0)]
    if getattr(model, "position_embedding_type", None) == "learned_absolute":
        expected.append(("embedding.position_embeddings.weight",
                         Role(("S", "H"), "model.embed_positions.weight", None), first, 0))
    if getattr(model.decoder, "post_layer_norm", True):
        expected.append(("decoder.final_layernorm.weight", Role(("H",), "model.norm.weight", None), last, pp - 1))
        if model.config.normalization == "LayerNorm":
            expected.append(("decoder.final_layernorm.bias", Role(("H",), "model.norm.bias", None), last, pp - 1))
    if not tied or pp > 1:  # tied at PP > 1: the last stage's copy is a replica of the embedding's key
        expected.append(("output_layer.weight", Role((vocab, "H"), "model.embed_tokens.weight" if tied
                                                     else "lm_head.weight", 0), last, pp - 1))
    known = {e[0] for e in expected}
    for pname in weights:
        if not _LAYER.fullmatch(pname) and pname not in known:
            raise BridgeError(f"parameter `{pname}` is outside the decoder layers and not one the bridge knows "
                              "(embedding, final layernorm, output layer)",
                              help="multi-token prediction, vision towers and other extra modules are not "
                                   "described by this bridge")
    out = []
    for pname, role, where, stage in expected:
        dtype, split = default, role.split if t.tp > 1 else None
        if pname in weights:
            dtype = _dtype(pname, weights[pname])
            split = _check_attributes(pname, weights[pname], role, t.tp, t.etp, t.ep)
            if dtype != default:
                raise BridgeError(f"parameter `{pname}` is {dtype} but config.params_dtype is {default}; other "
                                  "stages cannot see its dtype", help="keep it in config.params_dtype")
        elif stage == t.pp_rank:
            raise BridgeError(f"the model has no parameter `{pname}`, which Megatron keeps on pipeline stage "
                              f"{stage}")
        out.append((pname, _Param(pname, role, dtype, split), where))
    return out


def _render(name: str, model, t: _Trainer, templates, outside, V: int, default: str) -> str:
    config = model.config
    E = config.num_moe_experts or 0
    used = " ".join(" ".join(e.role.dims) for kind in templates.values() for e in kind)
    used += " " + " ".join(" ".join(p.role.dims) for _, p, _ in outside)
    if getattr(config, "multi_latent_attention", False):   # DeepSeek-V3's names for MLA's sizes
        attention = [("NH", config.num_attention_heads), ("Q_LORA", config.q_lora_rank),
                     ("KV_LORA", config.kv_lora_rank), ("QK_NOPE", config.qk_head_dim),
                     ("QK_ROPE", config.qk_pos_emb_head_dim), ("V_HEAD", config.v_head_dim)]
        attention = [(n, v) for n, v in attention if re.search(rf"\b{n}\b", used)]
    else:
        attention = [("Q", config.num_attention_heads), ("KV", config.num_query_groups or config.num_attention_heads),
                     ("QG", "Q/KV"), ("D", config.kv_channels)]
    consts = [("L", config.num_layers), ("H", config.hidden_size), *attention, ("V", V)]
    if E:
        consts.append(("E", E))
    for const, value in (("F", config.ffn_hidden_size),
                         ("I", config.moe_ffn_hidden_size or config.ffn_hidden_size),
                         ("FS", getattr(config, "moe_shared_expert_intermediate_size", None)),
                         ("S", getattr(model, "max_sequence_length", None))):
        if re.search(rf"\b{const}\b", used):
            consts.append((const, value))
    sizes = t.sizes
    head = (f"# Megatron-Core {type(model).__name__}: TP={t.tp} PP={t.pp} DP={sizes['dp']}"
            + (f" CP={sizes['cp']}" if "cp" in sizes else "")
            + (f" EP={t.ep} ETP={t.etp} EDP={sizes['edp']}" if E else "")
            + "; written by layoutlang.bridges.megatron.describe")
    lines = [head, f"layout {name}", "", "const " + ", ".join(f"{n} = {v}" for n, v in consts),
             t.dense.text("train")]
    if E:
        lines.append(t.experts.text("experts", at=True))
    lines += [f"default dtype {default}", ""]
    before = [o for o in outside if o[0].startswith("embedding.")]
    lines += [_statement(pname, p, "", where, "tp", "") for pname, p, where in before]
    lines += _layer_statements(templates, list(t.kinds), list(t.stages), t.pp, default)
    lines += [_statement(pname, p, "", where, "tp", "") for pname, p, where in outside
              if not pname.startswith("embedding.")]
    return "\n".join(lines) + "\n"


def _statement(pname: str, p: _Param, indent: str, where: str, axis: str, mesh: str,
               default: str | None = None) -> str:
    dims = [d + (f" over {axis}" if i == p.split else "") for i, d in enumerate(p.role.dims)]
    parts = [f"{indent}tensor {pname}"]
    if p.role.key is not None:
        parts.append(f"as {p.role.key}")
    parts.append("[" + ", ".join(dims) + "]")
    if default is not None and p.dtype != default:
        parts.append(p.dtype)
    if mesh:
        parts.append(f"on {mesh}")
    if where:
        parts.append(where)
    return " ".join(parts)


def _layer_statements(templates, kinds, stages, pp: int, default: str) -> list[str]:
    """Statements for every layer: one loop over pp when all layers are alike, else runs per stage."""
    out = [""]
    if len(set(kinds)) == 1:
        counts = [c for _, c in stages]
        if pp == 1:
            head, var = "for l in 0..L {", "{l}"
        elif len(set(counts)) == 1:
            head, var = "for l in 0..L over pp {", "{l.local}"
        else:
            head, var = f"for l in 0..L over pp sizes [{', '.join(map(str, counts))}] {{", "{l.local}"
        out.append(head)
        out += _layer_body(templates[kinds[0]], var, "", default)
        out.append("}")
        return out
    for stage, (offset, count) in enumerate(stages):
        l = offset
        while l < offset + count:
            end = l
            while end < offset + count and kinds[end] == kinds[l]:
                end += 1
            var = "{l}" if offset == 0 else f"{{l - {offset}}}"
            out.append(f"for l in {l}..{end} {{")
            out += _layer_body(templates[kinds[l]], var, f"at pp={stage}" if pp > 1 else "", default)
            out.append("}")
            l = end
    return out


def _layer_body(template: list[_Param], var: str, where: str, default: str) -> list[str]:
    out, expert_lines = [], []
    for p in template:
        pname = f"decoder.layers.{var}.{_megatron_name(p.rel)}"
        if p.role.expert:
            expert_lines.append(_statement(pname, p, "    ", where, "etp", "experts", default))
        else:
            out.append(_statement(pname, p, "  ", where, "tp", "", default))
    if expert_lines:
        out += ["  for e in 0..E over ep {"] + expert_lines + ["  }"]
    return out


def _stages(config, pp: int) -> list[tuple[int, int]]:
    """(first layer, layer count) of every pipeline stage, as Megatron computes them: evenly, with
    num_layers_in_first/last_pipeline_stage, account_for_embedding/loss_in_pipeline_split or a
    pipeline_model_parallel_layout (megatron_split.py writes the same split for `layoutc new`)."""
    if pp == 1:
        return [(0, config.num_layers)]
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:   # the block's helpers would ask parallel_state for the rank: ask the layout
        stages = [(layout.get_layer_offset(pp_rank=r), layout.get_num_layers_to_build(pp_rank=r))
                  for r in range(pp)]
    else:
        stages = [(get_transformer_layer_offset(config, None, r), get_num_layers_to_build(config, None, r))
                  for r in range(pp)]
    end = 0
    for r, (offset, count) in enumerate(stages):
        if offset != end:
            raise BridgeError(f"pipeline stage {r} starts at layer {offset}, not {end}: its layers are not "
                              "contiguous after the previous stage's")
        end += count
    if end != config.num_layers:
        raise BridgeError(f"the pipeline stages hold {end} layers but config.num_layers is {config.num_layers}")
    return stages


def _layer_kinds(config) -> list[str]:
    """`dense` or `moe` per layer, as Megatron's decoder block spec builds them."""
    L = config.num_layers
    if not config.num_moe_experts:
        return ["dense"] * L
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return ["moe" if i % freq == 0 else "dense" for i in range(L)]
    if len(freq) != L:
        raise BridgeError(f"moe_layer_freq lists {len(freq)} layers but config.num_layers is {L}")
    return ["moe" if f else "dense" for f in freq]


def _pad_multiple(V: int, padded: int, tp: int) -> int:
    """A K with roundup(V, K) == padded: Megatron's make_vocab_size_divisible_by * TP when it fits."""
    for k in (128, 64, 32, 16, 8, 4, 2, 1, 256, 512, 1024):
        K = k * tp
        if -(-V // K) * K == padded:
            return K
    return padded


def _check_against_model(text: str, params: dict, rank: int) -> None:
    """Elaborate `text` and compare this rank's tensors with the model's parameters."""
    from layoutlang import loads

    layout = loads(text, path="<megatron.describe>")
    expected = {t.name: t for t in layout.tensors if t.holds(rank)}
    for pname, p in params.items():
        t = expected.get(pname)
        if t is None:
            raise BridgeError(f"parameter `{pname}` is not described on rank {rank} (internal: the described "
                              "layout places it elsewhere)")
        shape = t.local_shape_at(rank)
        if tuple(p.shape) != tuple(shape):
            raise BridgeError(f"parameter `{pname}` on rank {rank} has shape {list(p.shape)}; the config and "
                              f"parallel sizes give {list(shape)} (`{t.key}`)",
                              help="the model's config does not match its parameters (a custom layer spec?)")
    missing = sorted(set(expected) - set(params))
    if missing:
        raise BridgeError(f"rank {rank} has no parameter `{missing[0]}` that the config says it holds"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def tensors(model) -> dict:
    """This rank's weights by layout NAME: the `.data` of each parameter (views, no copies), and
    the buffers the layout describes (the router's `expert_bias`)."""
    return {n: p.data for n, p in _weights(_unwrap(model)).items()}
