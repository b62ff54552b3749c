"""The SGLang loader end to end, without SGLang (it does not import here), run by tests/test_sglang.py.

    sglang_program.py trainer ARCH PORT CTRL TP        # SGLangTrainer, 1 rank: 3 refits, then close
    sglang_program.py engine ARCH PORT CTRL TP RANK    # one SGLang TP worker running the loader

What SGLang does between the two is played by a TCPStore on CTRL: the trainer's `update`
(what `engine.update_weights_from_tensor(named, load_format=LOADER)` is) posts the named
tensors as bytes and returns once every TP worker answered, (True, "Success") or (False,
their errors), as SGLang's Engine answers; each worker rebuilds the named tensors and calls
`load_weights(model, named)`, as SGLang's model runner calls a custom loader.

The worker's model is built here by hand as SGLang stores a TP rank of it (fused
`qkv_proj` of its heads, `gate_up_proj`, the vocabulary padded to 64 and split, FusedMoE's
`mlp.experts.w13_weight` / `w2_weight` of each expert's rows of this rank), filled with a
sentinel. After each refit every parameter is compared with the trainer's HF tensors of
that step sliced by those rules (`expected`), and the padding rows with zero (LANGUAGE.md 3:
a destination's padding elements are set to zero). Every line printed is JSON; the last is {"ok": true, ...} or the program exits 1.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch

STEPS = 3
TIMEOUT = 60.0
SENTINEL = -7.0
REPLICA = "sglang-0"
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "vocab_size": 100, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"}
QWEN3_MOE = dict(LLAMA, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", moe_intermediate_size=32,
                 num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                 norm_topk_prob=True)
ARCHS = {"llama": LLAMA, "qwen3_moe": QWEN3_MOE}


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def sizes(cfg) -> dict:
    return {"L": cfg["num_hidden_layers"], "H": cfg["hidden_size"], "F": cfg["intermediate_size"],
            "Q": cfg["num_attention_heads"], "KV": cfg["num_key_value_heads"], "D": cfg["head_dim"],
            "V": cfg["vocab_size"], "E": cfg.get("num_experts", 0), "I": cfg.get("moe_intermediate_size", 0)}


def checkpoint(cfg, step: int) -> dict[str, torch.Tensor]:
    """The trainer's HF tensors at `step` (checkpoint names and shapes, written out here)."""
    s = sizes(cfg)
    H, D = s["H"], s["D"]
    g = torch.Generator().manual_seed(step)
    shapes = {"model.embed_tokens.weight": (s["V"], H), "model.norm.weight": (H,), "lm_head.weight": (s["V"], H)}
    for layer in range(s["L"]):
        p = f"model.layers.{layer}"
        shapes |= {f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
                   f"{p}.self_attn.q_proj.weight": (s["Q"] * D, H), f"{p}.self_attn.k_proj.weight": (s["KV"] * D, H),
                   f"{p}.self_attn.v_proj.weight": (s["KV"] * D, H), f"{p}.self_attn.o_proj.weight": (H, s["Q"] * D)}
        if s["E"]:
            shapes |= {f"{p}.self_attn.q_norm.weight": (D,), f"{p}.self_attn.k_norm.weight": (D,),
                       f"{p}.mlp.gate.weight": (s["E"], H)}
            for e in range(s["E"]):
                q = f"{p}.mlp.experts.{e}"
                shapes |= {f"{q}.gate_proj.weight": (s["I"], H), f"{q}.up_proj.weight": (s["I"], H),
                           f"{q}.down_proj.weight": (H, s["I"])}
        else:
            shapes |= {f"{p}.mlp.gate_proj.weight": (s["F"], H), f"{p}.mlp.up_proj.weight": (s["F"], H),
                       f"{p}.mlp.down_proj.weight": (H, s["F"])}
    return {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[0] // tp
    return t[rank * n:(rank + 1) * n]


def _cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = t.shape[-1] // tp
    return t[..., rank * n:(rank + 1) * n]


def _heads(t: torch.Tensor, heads: int, rank: int, tp: int, D: int) -> torch.Tensor:
    """A TP rank's heads of a q/k/v projection: heads/tp each, or (heads < tp) head rank*heads//tp
    replicated, as SGLang's QKVParallelLinear loads them."""
    if heads >= tp:
        return _rows(t, rank, tp)
    h = rank * heads // tp
    return t[h * D:(h + 1) * D]


def expected(cfg, ck: dict, rank: int, tp: int) -> dict[str, tuple[torch.Tensor, int]]:
    """Each SGLang parameter of TP rank `rank`: (the rows it holds of the step's tensors, the
    rows of padding after them), from SGLang's storage rules (module docstring)."""
    s = sizes(cfg)
    D = s["D"]
    padded = -(-s["V"] // 64) * 64
    per = padded // tp
    out = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        real = ck[name][rank * per:min((rank + 1) * per, s["V"])]
        out[name] = (real, per - real.shape[0])
    out["model.norm.weight"] = (ck["model.norm.weight"], 0)
    for layer in range(s["L"]):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        for k in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[f"{p}.{k}"] = (ck[f"{p}.{k}"], 0)
        out[f"{a}.qkv_proj.weight"] = (torch.cat([_heads(ck[f"{a}.q_proj.weight"], s["Q"], rank, tp, D),
                                                  _heads(ck[f"{a}.k_proj.weight"], s["KV"], rank, tp, D),
                                                  _heads(ck[f"{a}.v_proj.weight"], s["KV"], rank, tp, D)]), 0)
        out[f"{a}.o_proj.weight"] = (_cols(ck[f"{a}.o_proj.weight"], rank, tp), 0)
        if s["E"]:
            for k in ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate.weight"):
                out[f"{p}.{k}"] = (ck[f"{p}.{k}"], 0)
            x = [f"{p}.mlp.experts.{e}" for e in range(s["E"])]
            out[f"{p}.mlp.experts.w13_weight"] = (torch.stack([
                torch.cat([_rows(ck[f"{q}.gate_proj.weight"], rank, tp), _rows(ck[f"{q}.up_proj.weight"], rank, tp)])
                for q in x]), 0)
            out[f"{p}.mlp.experts.w2_weight"] = (torch.stack([_cols(ck[f"{q}.down_proj.weight"], rank, tp)
                                                              for q in x]), 0)
        else:
            out[f"{p}.mlp.gate_up_proj.weight"] = (torch.cat([_rows(ck[f"{p}.mlp.gate_proj.weight"], rank, tp),
                                                              _rows(ck[f"{p}.mlp.up_proj.weight"], rank, tp)]), 0)
            out[f"{p}.mlp.down_proj.weight"] = (_cols(ck[f"{p}.mlp.down_proj.weight"], rank, tp), 0)
    return out


class Config(dict):
    """What an SGLang model's `config` gives the loader: a transformers config's `to_dict`."""

    def to_dict(self) -> dict:
        return dict(self)


def sglang_model(cfg, rank: int, tp: int) -> torch.nn.Module:
    """A module tree with SGLang's parameter names and this rank's shapes, filled with the sentinel."""
    model = torch.nn.Module()
    model.config = Config(cfg)
    for name, (real, pad) in expected(cfg, checkpoint(cfg, 0), rank, tp).items():
        *path, leaf = name.split(".")
        node = model
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        shape = (real.shape[0] + pad, *real.shape[1:])
        node.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, SENTINEL), requires_grad=False))
    return model


def differences(model, cfg, step: int, rank: int, tp: int) -> list[str]:
    out = []
    want = expected(cfg, checkpoint(cfg, step), rank, tp)
    have = dict(model.named_parameters())
    out += sorted(set(have) ^ set(want))
    for name, (real, pad) in want.items():
        t = have.get(name)
        if t is None:
            continue
        n = real.shape[0]
        if not torch.equal(t[:n], real) or not bool((t[n:n + pad] == 0).all()):
            out.append(name)
    return out


# ---- what SGLang does between trainer and workers ------------------------------------------------

def _store(port: int, master: bool):
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", port, is_master=master, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT))


class Engine:
    """`update_weights_from_tensor` of an SGLang engine of `tp` workers: post, wait for all."""

    def __init__(self, port: int, tp: int):
        self.kv, self.tp, self.n = _store(port, True), tp, 0

    def update(self, named) -> tuple[bool, str]:
        self.n += 1
        self.kv.set(f"msg/{self.n}", json.dumps([[name, t.numpy().tobytes().hex()] for name, t in named]))
        keys = [f"reply/{self.n}/{r}" for r in range(self.tp)]
        self.kv.wait(keys, timedelta(seconds=2 * TIMEOUT))
        errors = [self.kv.get(k).decode() for k in keys]
        errors = [e for e in errors if e != "ok"]
        return (not errors, "; ".join(errors) or "Success")


def run_trainer(arch: str, port: int, ctrl: int, tp: int) -> None:
    from layoutlang.bridges.families import model_from_config, render
    from layoutlang.elaborate import loads
    from layoutlang.integrations.sglang import SGLangTrainer, engine_layout

    cfg = ARCHS[arch]
    engine = Engine(ctrl, tp)
    trainer = SGLangTrainer(loads(render(model_from_config(cfg), "hf", {"DP": 1, "AT": 0}), "hf.layout"),
                            engine_layout(cfg, dtype="float32", tp=tp), address=f"127.0.0.1:{port}", rank=0,
                            world_size=1, update=engine.update, replica=REPLICA, timeout=TIMEOUT)
    for step in range(1, STEPS + 1):
        report = trainer.send_weights(checkpoint(cfg, step))
        say(role="trainer", step=step, replicas=list(report.replicas))
        if list(report.replicas) != [REPLICA]:
            sys.exit(1)
    trainer.close()
    say(ok=True, role="trainer", messages=engine.n)


def run_engine(arch: str, ctrl: int, tp: int, rank: int) -> None:
    from layoutlang.integrations import sglang

    sglang._parallel = lambda: (rank, tp, 1)  # SGLang's parallel state: this worker's TP rank
    cfg = ARCHS[arch]
    model = sglang_model(cfg, rank, tp)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    kv = _store(ctrl, False)
    kinds = []
    for n in range(1, 2 + STEPS + 1):
        kv.wait([f"msg/{n}"], timedelta(seconds=2 * TIMEOUT))
        named = [(name, torch.frombuffer(bytearray.fromhex(data), dtype=torch.uint8))
                 for name, data in json.loads(kv.get(f"msg/{n}"))]
        kind = named[0][0]
        kinds.append(kind)
        try:
            sglang.load_weights(model, named)
        except Exception as exc:  # noqa: BLE001 - SGLang answers the error to the caller
            kv.set(f"reply/{n}/{rank}", f"{type(exc).__name__}: {exc}")
            say(role="engine", error=str(exc))
            sys.exit(1)
        kv.set(f"reply/{n}/{rank}", "ok")
        if kind == "layoutlang.update":
            step = kinds.count(kind)
            say(role="engine", step=step, version=sglang._WORKERS[model].job.version,
                differ=differences(model, cfg, step, rank, tp),
                moved=[k for k, p in model.named_parameters() if p.data_ptr() != ptrs[k]])
        if kind == "layoutlang.close":
            break
    say(ok=True, role="engine", kinds=kinds, workers=len(sglang._WORKERS),
        elements=sum(p.numel() for p in model.parameters()))


if __name__ == "__main__":
    what, arch, *rest = sys.argv[1:]
    if what == "trainer":
        run_trainer(arch, int(rest[0]), int(rest[1]), int(rest[2]))
    else:
        run_engine(arch, int(rest[1]), int(rest[2]), int(rest[3]))
