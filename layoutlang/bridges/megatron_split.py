"""How Megatron-Core splits a decoder's layers over pipeline stages, from Megatron-LM's own args.

`layoutc new megatron --set PP=4` of a model whose layer count PP does not
divide (DeepSeek-V3: 61 layers) needs the split the trainer runs with. Megatron
takes it from one of three sets of args (megatron-core 0.19, read from
`TransformerConfig.__post_init__`, `transformer_block.get_num_layers_to_build`
and `transformer_layer.get_transformer_layer_offset`; tests/test_megatron_split.py
compares every count below with those functions):

- `decoder_first_pipeline_num_layers` / `decoder_last_pipeline_num_layers`
  (TransformerConfig's `num_layers_in_first/last_pipeline_stage`): the first
  and/or last stage hold that many layers, the stages between share the rest
  equally (it must divide);
- `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split`:
  the embedding (loss) counts as one more layer, L + 1 (+ 1) layers split evenly,
  and the first (last) stage builds one layer fewer;
- `pipeline_model_parallel_layout`: each stage's layers written out, `|` between
  stages (`"Et*15|t*16|t*16|t*14L"`: E the embedding, t a decoder layer, m an
  MTP layer, L the loss; `(..)*n` and `x*n` repeat), or a list of lists of
  LayerType names.

Without any of them, L must divide by PP (Megatron asserts it); where it does
not, `pipeline_split` picks the first/last split Megatron users write for such
models (`megatron_default`): stages between of cdiv(L, PP) layers, the rest on
the first and last stage, the last one lighter (it also computes the loss).

>>> pipeline_split(61, 4, {}).stages, pipeline_split(61, 4, {}).flags
((15, 16, 16, 14), ('--decoder-first-pipeline-num-layers 15', '--decoder-last-pipeline-num-layers 14'))
>>> pipeline_split(8, 2, {"pipeline_model_parallel_layout": "Ettt|t*5L"}).stages
(3, 5)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from ..diagnostics import UsageError

FIRST, LAST = "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"
EMBEDDING, LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"
LAYOUT = "pipeline_model_parallel_layout"
SPLIT_ARGS = (FIRST, LAST, EMBEDDING, LOSS, LAYOUT)   # what `layoutc new megatron --set` takes besides the args
FLAGS = (EMBEDDING, LOSS)                            # true or false (1 or 0)

# Megatron's layout letters and LayerType names (pipeline_parallel_layer_layout.py)
_LETTERS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
_NAMES = ("embedding", "loss", "encoder", "decoder", "mtp")
_MAX_LAYOUT = 1 << 20   # layer entries a layout may unroll to (input is data: `t*10**12` is refused)


@dataclass(frozen=True)
class PipelineSplit:
    """The decoder layers each pipeline stage holds, and the Megatron-LM flags that give that split.

    `flags` is empty for the even split (no flag needed); `chosen`: layoutc picked the split
    (no split arg was given and PP does not divide L), so the trainer must be run with `flags`.
    """

    stages: tuple[int, ...]
    flags: tuple[str, ...] = ()
    chosen: bool = False
    mtp: int = 0            # MTP layers a layout places (`m`): not decoder layers, not described

    @property
    def even(self) -> bool:
        return not self.flags

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first layer of each stage (Megatron's get_transformer_layer_offset)."""
        out, at = [], 0
        for n in self.stages:
            out.append(at)
            at += n
        return tuple(out)


def _usage(message: str, help: str | None = None) -> UsageError:
    return UsageError(message, help=help or f"set Megatron's split with --set {FIRST}=N / {LAST}=N, "
                                            f"--set {EMBEDDING}=1 / {LOSS}=1, or --set {LAYOUT}=...")


def _flag(options: Mapping[str, object], name: str) -> bool:
    value = options.get(name, False)
    if value in (0, 1) or isinstance(value, bool):   # (True == 1, False == 0)
        return bool(value)
    raise _usage(f"--set {name}={value}: expected 1 or 0 (true or false)")


def _count(options: Mapping[str, object], name: str) -> int | None:
    value = options.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _usage(f"--set {name}={value}: expected a positive integer (Megatron requires at least one layer "
                     "on that stage)")
    return value


def megatron_default(layers: int, pp: int) -> dict[str, int]:
    """The first/last split layoutc picks when PP does not divide L: cdiv(L, PP) layers on every
    stage between, the rest on the first and last (the last one fewer when it is odd).

    >>> megatron_default(61, 8), megatron_default(61, 16), megatron_default(61, 2)
    ({'decoder_first_pipeline_num_layers': 7, 'decoder_last_pipeline_num_layers': 6}, \
{'decoder_first_pipeline_num_layers': 3, 'decoder_last_pipeline_num_layers': 2}, \
{'decoder_first_pipeline_num_layers': 31, 'decoder_last_pipeline_num_layers': 30})
    """
    middle = -(-layers // pp) if pp > 2 else 0
    rest = layers - (pp - 2) * middle
    return {FIRST: rest - rest // 2, LAST: rest // 2}


def pipeline_split(layers: int, pp: int, options: Mapping[str, object]) -> PipelineSplit:
    """The layers of each of `pp` stages as Megatron-Core splits `layers` under `options`
    (a subset of SPLIT_ARGS); a UsageError naming the args where Megatron refuses them."""
    given = {k: v for k, v in options.items() if k in SPLIT_ARGS and v not in (None, False, 0)}
    unknown = sorted(set(options) - set(SPLIT_ARGS))
    assert not unknown, unknown
    if pp == 1:
        if given:
            raise UsageError(f"--set {next(iter(given))}=...: PP=1 keeps every layer on one stage, so there is "
                             "no pipeline split to choose", help="set PP=2 or more with it, or leave it out")
        return PipelineSplit((layers,))
    if LAYOUT in given:
        if len(given) > 1:
            others = ", ".join(k for k in given if k != LAYOUT)
            raise _usage(f"--set {LAYOUT} cannot be combined with {others} (Megatron refuses the pair)",
                         help=f"write the whole split in {LAYOUT}, or leave it out")
        return _from_layout(layers, pp, given[LAYOUT])
    first, last = _count(options, FIRST), _count(options, LAST)
    embedding, loss = _flag(options, EMBEDDING), _flag(options, LOSS)
    if (first or last) and (embedding or loss):
        raise _usage(f"--set {FIRST if first else LAST} cannot be combined with "
                     f"{EMBEDDING if embedding else LOSS} (Megatron refuses the pair)",
                     help="use either the first/last stage sizes or the embedding/loss accounting")
    if first or last:
        return _first_last(layers, pp, first, last)
    if embedding or loss:
        return _accounting(layers, pp, embedding, loss)
    if layers % pp == 0:
        return PipelineSplit((layers // pp,) * pp)
    default = megatron_default(layers, pp)
    if min(default.values()) < 1:
        raise _usage(f"PP={pp} does not divide the {layers} layers, and {pp} stages are too many for the first/"
                     "last split layoutc picks otherwise (each stage needs at least one layer)",
                     help=f"choose a smaller PP, or write the split with --set {LAYOUT}=...")
    split = _first_last(layers, pp, default[FIRST], default[LAST])
    return PipelineSplit(split.stages, split.flags, chosen=True)


def _first_last(layers: int, pp: int, first: int | None, last: int | None) -> PipelineSplit:
    """num_layers_in_first/last_pipeline_stage (TransformerConfig's checks, get_num_layers_to_build)."""
    middle_layers = layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    said = " and ".join(f"{n}={v}" for n, v in ((FIRST, first), (LAST, last)) if v is not None)
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
            middle_stages and middle_layers % middle_stages):
        where = (f"{middle_layers} layers for the {middle_stages} stage(s) between" if middle_stages
                 else f"{middle_layers} layers and no stage between")
        raise _usage(f"--set {said}: {layers} layers over PP={pp} leave {where}; Megatron needs the stages "
                     "between to hold an equal share (at least one layer)",
                     help=(f"choose values that leave a multiple of {middle_stages} layers" if middle_stages > 0
                           else f"with PP={pp} the first and last stage hold all {layers} layers")
                     + _suggestion(layers, pp))
    share = middle_layers // middle_stages if middle_stages else 0
    stages = [share] * pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    flags = tuple(f"--{n.replace('_', '-')} {v}" for n, v in ((FIRST, first), (LAST, last)) if v is not None)
    return PipelineSplit(tuple(stages), flags)


def _suggestion(layers: int, pp: int) -> str:
    """`, e.g. ...`: the split layoutc picks without args, where it is one."""
    default = megatron_default(layers, pp)
    if min(default.values()) < 1 or layers % pp == 0:
        return ""
    return ", e.g. " + " ".join(f"--set {k}={v}" for k, v in default.items())


def _accounting(layers: int, pp: int, embedding: bool, loss: bool) -> PipelineSplit:
    """account_for_embedding/loss_in_pipeline_split: L + 1 (+ 1) layers split evenly, one fewer built
    on the first (last) stage."""
    counted = layers + embedding + loss
    names = " and ".join(n for n, on in ((EMBEDDING, embedding), (LOSS, loss)) if on)
    if counted % pp:
        raise _usage(f"--set {names}: {layers} layers + {embedding + loss} counted for the "
                     f"{'embedding and loss' if embedding and loss else 'embedding' if embedding else 'loss'} "
                     f"= {counted}, which PP={pp} does not divide (Megatron requires it)")
    share = counted // pp
    stages = [share] * pp
    stages[0] -= embedding
    stages[-1] -= loss
    if min(stages) < 0:
        raise _usage(f"--set {names}: {counted} counted layers over PP={pp} leave the first or last stage "
                     "fewer than zero decoder layers")
    flags = tuple(f"--{n.replace('_', '-')}" for n, on in ((EMBEDDING, embedding), (LOSS, loss)) if on)
    return PipelineSplit(tuple(stages), flags)


def _unroll(text: str) -> str:
    """Megatron's parse_str_to_list: commas dropped, `(..)*n` then `x*n` repeated, bounded."""
    def times(match: re.Match) -> str:
        body, n = match.group(1), int(match.group(2))
        if len(body) * n > _MAX_LAYOUT:
            raise _usage(f"--set {LAYOUT}: `{match.group(0)}` unrolls to more than {_MAX_LAYOUT} layers")
        return body * n

    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, times, text)
        if len(text) > _MAX_LAYOUT:
            raise _usage(f"--set {LAYOUT}: the layout unrolls to more than {_MAX_LAYOUT} layers")
    return text


def _layout_stages(value: object) -> list[list[str]]:
    """Each stage's LayerType names, from a layout string or a list of lists."""
    if isinstance(value, str):
        out = []
        for stage in _unroll(value).split("|"):
            bad = sorted(set(stage) - set(_LETTERS))
            if bad:
                raise _usage(f"--set {LAYOUT}={value}: `{bad[0]}` is not a layer letter",
                             help="E embedding, t decoder layer, m MTP layer, L loss; `|` between stages, "
                                  "`(..)*n` or `x*n` repeats")
            out.append([_LETTERS[c] for c in stage])
        return out
    if isinstance(value, list) and all(isinstance(s, list) and all(isinstance(x, str) for x in s) for s in value):
        out = []
        for stage in value:
            names = [x.strip().lower() for x in stage]
            bad = [x for x in names if x not in _NAMES]
            if bad:
                raise _usage(f"--set {LAYOUT}: `{bad[0]}` is not a Megatron LayerType",
                             help=f"one of {', '.join(_NAMES)}")
            out.append(names)
        return out
    raise _usage(f"--set {LAYOUT}={value!r}: expected a layout string (`Et*3|(tt|)*29,m|L`) or a list of "
                 "lists of layer names")


def _from_layout(layers: int, pp: int, value: object) -> PipelineSplit:
    """pipeline_model_parallel_layout: PipelineParallelLayerLayout's checks and decoder counts."""
    stages = _layout_stages(value)
    shown = value if isinstance(value, str) else "[...]"
    if len(stages) % pp:
        raise _usage(f"--set {LAYOUT}={shown}: {len(stages)} stages, which PP={pp} does not divide")
    if len(stages) != pp:
        raise _usage(f"--set {LAYOUT}={shown}: {len(stages)} stages over PP={pp} make {len(stages) // pp} "
                     "virtual pipeline stages per rank, which `layoutc new megatron` does not describe",
                     help=f"write one stage per pipeline rank ({pp} stages)")
    flat = [x for stage in stages for x in stage]
    problems = [(not flat or flat[0] != "embedding", "the first layer must be the embedding (E)"),
                (not flat or flat[-1] != "loss", "the last layer must be the loss (L)"),
                (flat.count("embedding") != 1, "the embedding (E) must appear exactly once"),
                (flat.count("loss") != 1, "the loss (L) must appear exactly once"),
                (flat.count("decoder") != layers, f"it places {flat.count('decoder')} decoder layers (t), the "
                                                  f"model has {layers}"),
                ("encoder" in flat, "encoder layers are not supported by Megatron's layouts"),
                ("mtp" in flat and "decoder" in flat[flat.index("mtp"):], "decoder layers must come before MTP "
                                                                          "layers")]
    for bad, why in problems:
        if bad:
            raise _usage(f"--set {LAYOUT}={shown}: {why}")
    return PipelineSplit(tuple(stage.count("decoder") for stage in stages),
                         (f"--pipeline-model-parallel-layout '{shown}'",) if isinstance(value, str)
                         else ("pipeline_model_parallel_layout=" + repr(value),), mtp=flat.count("mtp"))
