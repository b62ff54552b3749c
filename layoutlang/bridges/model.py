"""A model family's shape from its HF config, and the `.layout` document every convention writes.

What the conventions share (families.py, megatron_layout.py, torchtitan_layout.py each write
theirs from it): `model_from_config` reads a config.json into a `Model`; a `Document` of
`Tensor` and `Loop` statements renders to `.layout` text (`render_document`); the HF key of a
layer's weight (`layer_key`), part lists (`parts_text`), a head's rotary halves
(`rotary_rows`), the consts and header every document starts with (`const_lines`,
`header_lines`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Mapping

from ..diagnostics import LayoutError, UsageError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # config `dtype` -> layout dtype


class ConfigError(UsageError):
    """config.json lacks a field a family needs, or holds a value this module cannot describe."""


class BridgeError(LayoutError):
    """A live model cannot be described: a parameter the layout does not cover, a wrong shape."""


# ---- what a config says ---------------------------------------------------------------------

@dataclass(frozen=True)
class GQA:
    """Grouped-query attention: q_proj [Q*D, H], k_proj / v_proj [KV*D, H], o_proj [H, Q*D]."""

    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False     # Qwen3: q_norm / k_norm [D]
    sinks: bool = False       # gpt-oss: one learned sink logit per head [Q]


@dataclass(frozen=True)
class MLA:
    """DeepSeek multi-head latent attention (q_lora None: a plain q_proj)."""

    heads: int
    q_lora: int | None
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int


@dataclass(frozen=True)
class MoE:
    """Routed experts (gate|up [I, H] each, down [H, I]) and what surrounds them.

    `block`, `router` and the expert weight names are the checkpoint's
    (Mixtral: `block_sparse_moe`, `w1`/`w3`/`w2`).
    """

    experts: int
    inter: int
    block: str = "mlp"
    router: str = "gate"
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared: int | None = None     # intermediate size of the shared expert MLP
    shared_name: str = "shared_experts"
    shared_gate: bool = False     # Qwen2-MoE: sigmoid gate on the shared expert [1, H]
    score_bias: bool = False      # DeepSeek-V3: router e_score_correction_bias [E] fp32
    router_bias: bool = False     # gpt-oss
    expert_bias: bool = False     # gpt-oss: biases on every expert weight
    interleaved: bool = False     # gpt-oss: gate/up interleaved where stacked
    router_last: bool = False     # transformers builds the experts before the router (Qwen3-MoE, DeepSeek-V3)


@dataclass(frozen=True)
class Model:
    """The weights of one model, as its config.json says. `moe_layers[l]`: layer l routes."""

    model_type: str
    layers: int
    hidden: int
    vocab: int
    tied: bool
    dtype: str
    attention: GQA | MLA
    dense: int | None              # intermediate size of the dense MLP layers (None: there are none)
    moe: MoE | None
    moe_layers: tuple[bool, ...]
    architecture: str | None = None  # config.json's `architectures[0]` (the transformers class), if it says

    @property
    def runs(self) -> tuple[tuple[int, int, bool], ...]:
        """Maximal runs of layers of one kind: (start, stop, routed)."""
        out: list[tuple[int, int, bool]] = []
        for l, routed in enumerate(self.moe_layers):
            if out and out[-1][2] == routed:
                out[-1] = (out[-1][0], l + 1, routed)
            else:
                out.append((l, l + 1, routed))
        return tuple(out)


def _read_field(config: Mapping, name: str, *, default=None, kind=int, alias: tuple[str, ...] = (),
                source: str = "config.json"):
    """config[name] (or an alias), checked: a missing field without a default is a ConfigError."""
    for key in (name, *alias):
        if key in config and config[key] is not None:
            value = config[key]
            break
    else:
        if default is not None:
            return default
        mt = config.get("model_type")
        raise ConfigError(f"{source}: missing field `{name}`" + (f" (model_type {mt} needs it)" if mt else ""),
                          help=f"add \"{name}\": ... to {source}" + (f" (or {', '.join(alias)})" if alias else ""))
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConfigError(f"{source}: field `{key}` is {value!r}, expected a positive integer")
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: field `{key}` is {value!r}, expected true or false")
    return value


def _count(config: Mapping, name: str, source: str) -> int:
    """A non-negative integer field that defaults to 0 (first_k_dense_replace)."""
    value = config.get(name) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{source}: field `{name}` is {value!r}, expected an integer >= 0")
    return value


def model_from_config(config: Mapping, *, source: str = "config.json") -> Model:
    """Read a HF config dict (config.json, or `model.config.to_dict()`) into a Model.

    Fields transformers itself defaults are defaulted the same way
    (num_key_value_heads = num_attention_heads, head_dim = hidden_size //
    num_attention_heads, tie_word_embeddings false, dtype bf16); any other
    missing field is a ConfigError naming it (and `source`, the file it came from).
    """
    need = partial(_read_field, config, source=source)  # every field of this config, read from `source`
    flag = lambda name, default: need(name, default=default, kind=bool)  # noqa: E731
    if "model_type" not in config:
        raise ConfigError(f"{source}: missing field `model_type`", help=f"known families: {', '.join(FAMILIES)}")
    mt = config["model_type"]
    if mt not in FAMILIES:
        raise ConfigError(f"{source}: model_type `{mt}` is not a family `layoutc new` knows",
                          help=f"known families: {', '.join(FAMILIES)}")
    hidden = need("hidden_size")
    layers = need("num_hidden_layers")
    vocab = need("vocab_size")
    heads = need("num_attention_heads")
    tied = need("tie_word_embeddings", default=False, kind=bool)
    raw_dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if raw_dtype not in DTYPES:
        raise ConfigError(f"{source}: dtype `{raw_dtype}` has no layout dtype",
                          help=f"use one of {', '.join(DTYPES)}")
    if config.get("mlp_bias"):
        raise ConfigError(f"{source}: `mlp_bias: true` is not described by `layoutc new`",
                          help="biases on the MLP weights are not written for any family yet")
    moe: MoE | None = None
    dense: int | None = None
    routed = [False] * layers
    if mt == "deepseek_v3":
        q_lora = config.get("q_lora_rank")
        if q_lora is not None:
            q_lora = need("q_lora_rank")
        attention: GQA | MLA = MLA(heads, q_lora, need("kv_lora_rank"), need("qk_nope_head_dim"),
                                   need("qk_rope_head_dim"), need("v_head_dim"))
    else:
        kv = need("num_key_value_heads", default=heads)
        head_dim = need("head_dim", default=hidden // heads)
        # as transformers builds them: Qwen2 always has q/k/v biases (no o bias), Qwen2-MoE by `qkv_bias`,
        # the others by `attention_bias` (on q/k/v and o), which gpt-oss defaults to true
        if mt == "qwen2":
            bias = True
        elif mt == "qwen2_moe":
            bias = flag("qkv_bias", True)
        else:
            bias = flag("attention_bias", mt == "gpt_oss")
        attention = GQA(heads, kv, head_dim, qkv_bias=bias,
                        o_bias=bias and mt not in ("qwen2", "qwen2_moe"),
                        qk_norm=mt in ("qwen3", "qwen3_moe"), sinks=mt == "gpt_oss")
    if mt in ("llama", "mistral", "qwen2", "qwen3"):
        dense = need("intermediate_size")
    elif mt in ("mixtral", "gpt_oss"):
        experts = need("num_local_experts", alias=("num_experts",))
        inter = need("intermediate_size")
        moe = (MoE(experts, inter, block="block_sparse_moe", names=("w1", "w3", "w2")) if mt == "mixtral" else
               MoE(experts, inter, router="router", router_bias=True, expert_bias=True, interleaved=True))
        routed = [True] * layers
    elif mt in ("qwen2_moe", "qwen3_moe"):
        experts = need("num_experts", alias=("num_local_experts",))
        step = need("decoder_sparse_step", default=1)
        only = config.get("mlp_only_layers") or []
        routed = [l not in only and (l + 1) % step == 0 for l in range(layers)]
        dense = need("intermediate_size") if not all(routed) else None
        shared = need("shared_expert_intermediate_size") if mt == "qwen2_moe" else None
        moe = MoE(experts, need("moe_intermediate_size"), shared=shared, shared_name="shared_expert",
                  shared_gate=mt == "qwen2_moe", router_last=mt == "qwen3_moe")
    else:  # deepseek_v3
        first = _count(config, "first_k_dense_replace", source)
        routed = [l >= first for l in range(layers)]
        dense = need("intermediate_size") if first else None
        inter = need("moe_intermediate_size")
        moe = MoE(need("n_routed_experts"), inter, shared=inter * need("n_shared_experts"),
                  score_bias=True, router_last=True)
    if moe is None or not any(routed):
        moe, routed = None, [False] * layers
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    return Model(mt, layers, hidden, vocab, tied, DTYPES[raw_dtype], attention, dense, moe, tuple(routed), arch)


# ---- the text: statements with a line each ---------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    """One `tensor` statement: NAME, optional KEY, dims as text (canonical style)."""

    name: str
    dims: tuple[str, ...]
    key: str | None = None
    dtype: str | None = None
    transposed: bool = False
    mesh: str | None = None
    at: str | None = None

    def text(self, default_dtype: str) -> str:
        out = f"tensor {self.name}"
        if self.key is not None and self.key != self.name:
            out += f" as {self.key}"
        out += f" [{', '.join(self.dims)}]"
        if self.dtype is not None and self.dtype != default_dtype:
            out += f" {self.dtype}"
        if self.transposed:
            out += " transposed"
        if self.mesh is not None:
            out += f" on {self.mesh}"
        if self.at is not None:
            out += f" at {self.at}"
        return out


@dataclass(frozen=True)
class Loop:
    """`for VAR in START..STOP [over AXIS [sizes [...]]] { body }`; `comment` goes on the line before it."""

    var: str
    start: str
    stop: str
    body: tuple[Stmt, ...]
    over: str | None = None
    comment: str | None = None
    sizes: tuple[str, ...] | None = None   # with `over`: one block per coordinate (uneven pipeline stages)


Stmt = Tensor | Loop


@dataclass(frozen=True)
class Document:
    """A whole generated `.layout`: header comments, args, consts, meshes, statements."""

    name: str
    comments: tuple[str, ...]
    args: tuple[tuple[str, int], ...]
    consts: tuple[str, ...]           # each `A = 1, B = 2` (one `const` line)
    meshes: tuple[str, ...]           # each `NAME (axes) at AT`
    dtype: str
    body: tuple[Stmt, ...]
    notes: tuple[str, ...] = field(default=())  # comment lines before the body


def render_document(doc: Document) -> tuple[str, dict[int, tuple[int, ...]]]:
    """The canonical text of `doc` and, per 1-based line, the path of the tensor statement on it.

    A path indexes `doc.body`, then a loop's body, and so on: `(3, 0)` is the
    first statement of the fourth top-level statement.
    """
    lines: list[str] = [f"# {c}" if c else "#" for c in doc.comments]
    lines.append(f"layout {doc.name}")
    lines.append("")
    lines += [f"arg {name} = {value}" for name, value in doc.args]
    lines += [f"const {c}" for c in doc.consts]
    lines.append("")
    lines += [f"mesh {m}" for m in doc.meshes]
    if doc.dtype != "bf16":
        lines.append(f"default dtype {doc.dtype}")
    where: dict[int, tuple[int, ...]] = {}
    if doc.notes:
        lines.append("")
        lines += [f"# {n}" if n else "#" for n in doc.notes]
    else:
        lines.append("")

    def block(stmts: tuple[Stmt, ...], depth: int, path: tuple[int, ...]) -> None:
        pad = "  " * depth
        for i, stmt in enumerate(stmts):
            if isinstance(stmt, Tensor):
                lines.append(pad + stmt.text(doc.dtype))
                where[len(lines)] = (*path, i)
                continue
            if depth == 0 and lines[-1] != "" and not lines[-1].startswith("#"):
                lines.append("")
            if stmt.comment:
                lines.append(f"{pad}# {stmt.comment}")
            over = f" over {stmt.over}" if stmt.over else ""
            if stmt.sizes is not None:
                over += f" sizes [{', '.join(stmt.sizes)}]"
            lines.append(f"{pad}for {stmt.var} in {stmt.start}..{stmt.stop}{over} {{")
            block(stmt.body, depth + 1, (*path, i))
            lines.append(pad + "}")

    block(doc.body, 0, ())
    return "\n".join(lines) + "\n", where


def statement_at(doc: Document, path: tuple[int, ...]) -> Tensor:
    stmt: Stmt = doc.body[path[0]]
    for i in path[1:]:
        assert isinstance(stmt, Loop)
        stmt = stmt.body[i]
    assert isinstance(stmt, Tensor)
    return stmt


def layer_of(template: str, name: str) -> int | None:
    """The layer number `{l}` takes in `template` (a statement's name) to give `name` (a live parameter's)."""
    if "{l}" not in template:
        return None
    match = re.fullmatch(re.escape(template).replace(re.escape("{l}"), r"(\d+)"), name)
    assert match is not None, (template, name)
    return int(match.group(1))


def with_dtypes(doc: Document, dtypes: Mapping[tuple[int, ...], str]) -> Document:
    """`doc` with the tensor statements at the given paths set to other dtypes."""

    def block(stmts: tuple[Stmt, ...], path: tuple[int, ...]) -> tuple[Stmt, ...]:
        out = []
        for i, stmt in enumerate(stmts):
            here = (*path, i)
            if isinstance(stmt, Tensor):
                out.append(replace(stmt, dtype=dtypes[here]) if here in dtypes else stmt)
            else:
                out.append(replace(stmt, body=block(stmt.body, here)))
        return tuple(out)

    return replace(doc, body=block(doc.body, ()))


# ---- names and dims shared by the conventions -------------------------------------------------

def layer_key(rest: str) -> str:
    """A per-layer HF checkpoint key (the `{l}` of the enclosing layer loop)."""
    return f"model.layers.{{l}}.{rest}"


def parts_text(*parts: tuple[str, str, str]) -> str:
    """`(name: extent as KEY | ...)` from (name, extent, key)."""
    return "(" + " | ".join(f"{n}: {e} as {k}" for n, e, k in parts) + ")"


ROTARY_HALVES = "(re: D/2 | im: D/2)"  # one head's q/k rows under rotary, as HF stores them


def rotary_rows(heads: str | None) -> str:
    """q/k rows of `heads` heads (None: one head) as HF, vLLM, SGLang and Megatron store them:
    each head's rotary halves, `rotate_half`'s re rows then im rows (LANGUAGE.md 3).

    Every GQA family here rotates q and k, and a Meta-order source (torchtitan's Llama3,
    Meta's checkpoints: `(NH, D/2, (re: 1 | im: 1))`) names those parts; two matched dims need
    the same parts on both sides, so the conventions write them. Pairs between these
    conventions plan as the plain rows did (layoutlang/compiler/pieces.py: storage continues on both).
    >>> rotary_rows("Q"), rotary_rows(None)
    ('(Q, (re: D/2 | im: D/2))', '(re: D/2 | im: D/2)')
    """
    return ROTARY_HALVES if heads is None else f"({heads}, {ROTARY_HALVES})"


ROTARY_KEY = re.compile(r"model\.layers\.\d+\.self_attn\.(q|k)_proj\.(?:weight|bias)")


def rotary_heads(m: Model) -> dict[str, tuple[int, int]]:
    """{"q": (Q, D), "k": (KV, D)}: the heads and head dim of the checkpoint keys that every
    convention writes as rotary halves (`rotary_rows`); empty for MLA (its rope rows are parts of
    their own). What a checkpoint read from headers (layoutlang.checkpoint.describe) needs to
    write its `q_proj` / `k_proj` rows as the conventions do: keys matching `ROTARY_KEY`.
    >>> cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
    ...        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 500}
    >>> rotary_heads(model_from_config(cfg))
    {'q': (4, 16), 'k': (2, 16)}
    """
    a = m.attention
    if not isinstance(a, GQA) or a.head_dim % 2:
        return {}
    return {"q": (a.heads, a.head_dim), "k": (a.kv_heads, a.head_dim)}


def const_lines(m: Model, *, megatron: bool = False) -> tuple[str, ...]:
    out = [f"L = {m.layers}, H = {m.hidden}, V = {_int(m.vocab)}"]
    a = m.attention
    if isinstance(a, GQA):
        out.append(f"Q = {a.heads}, KV = {a.kv_heads}, D = {a.head_dim}" + (", QG = Q/KV" if megatron else ""))
    else:
        out.append(f"NH = {a.heads}, " + (f"Q_LORA = {a.q_lora}, " if a.q_lora else "")
                   + f"KV_LORA = {a.kv_lora}, QK_NOPE = {a.qk_nope}, QK_ROPE = {a.qk_rope}, V_HEAD = {a.v_head}")
    sizes = []
    if m.dense is not None:
        sizes.append(f"F = {_int(m.dense)}")
    if m.moe is not None:
        sizes += [f"E = {m.moe.experts}", f"I = {_int(m.moe.inter)}"]
        if m.moe.shared:
            sizes.append(f"S = {_int(m.moe.shared)}")
    if sizes:
        out.append(", ".join(sizes))
    return tuple(out)


def _int(n: int) -> str:
    """Large integers with `_` separators, as the examples write them (128_256)."""
    return f"{n:_}" if n >= 100_000 else str(n)


def header_lines(m: Model, convention: str, lines: list[str]) -> tuple[str, ...]:
    kind = ("MoE " if m.moe else "") + ("MLA " if isinstance(m.attention, MLA) else "")
    first = f"{m.model_type} ({kind}{m.layers} layers, hidden {m.hidden}) in the {convention} convention,"
    return (first, "written by `layoutc new` from its config.json. Keys are the HF checkpoint names",
            "of the unfused, per-expert weights (LANGUAGE.md 8): any two layouts written",
            "to this convention pair without edits.", "", *lines)
