"""The gloo ranks of tests/test_checkpoint_io.py: checkpoint load and save on 2 real processes (issue 28).

Run by `layoutlang.runtime.launch.launch(job, 2, program=__file__)` as
`python checkpoint_program.py JOB.json OUT.json`. One launch does every
multi-process case, in this order (each rank's report says what it checked):

1. load a `save_pretrained` Llama into `layoutc new vllm --set TP=2`,
   `megatron --set TP=2` and `hf --set DP=2` layouts (and vllm again with
   `exchange=True`): destinations filled with NaN, then EVERY element compared
   with what the format rule below (written by hand from the layout text and
   LANGUAGE.md 3) takes from the HF tensors, which are read with `safe_open`;
2. a load where rank 1 passes a misshapen tensor: rank 1 fails naming it and
   writes nothing, rank 0 fails too (the group fails together);
3. save from an FSDP2 HF Llama (the dtensor bridge), in its dtype and cast to
   bf16, and rank 0 writes the reference: the unsharded copy of the model,
   `save_pretrained` (the parent compares keys, shapes, bytes and logits); then
   that reference loaded into a fresh FSDP2 model, compared through `full_tensor`;
4. save from a Megatron-Core GPTModel at TP2 (the megatron bridge); the
   reference is an HF Llama built from the Megatron weights gathered over TP and
   un-fused by hand (Megatron's grouped qkv, fc1 = gate | up per rank), checked
   here against Megatron's own logits, then `save_pretrained`;
5. save of a TP2 layout of mxfp8 keys (shards quantized by the reference) and fp32 keys
   (one split, one replicated on both ranks);
6. a save whose rank 0 raises inside `write_pieces`: both ranks raise;
7. last, a save whose rank 1 dies (`os._exit`) right after writing its pieces:
   rank 0 must raise (not hang, not publish). Rank 1 writes its report first.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- the formats' rules, by hand ---------------------------------------------------------------------

def padded_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """`t` with its rows padded with zeros up to a multiple of `multiple` (LANGUAGE.md 3: `V pad K`)."""
    n = -(-t.shape[0] // multiple) * multiple
    out = torch.zeros((n, *t.shape[1:]), dtype=t.dtype)
    out[:t.shape[0]] = t
    return out


def block(t: torch.Tensor, r: int, parts: int, dim: int = 0) -> torch.Tensor:
    """Coordinate r's contiguous block of `parts` equal blocks along `dim`."""
    n = t.shape[dim] // parts
    return t.narrow(dim, r * n, n)


def heads(t: torch.Tensor, first: int, count: int, d: int) -> torch.Tensor:
    """Rows of heads first..first+count (head size d) of a [heads*d, H] projection."""
    return t[first * d:(first + count) * d]


def vocab_pad_rows(V: int, multiple: int, r: int, tp: int) -> int:
    """How many of rank r's rows of `V pad multiple over tp` are padding."""
    return int((block(padded_rows(torch.ones(V), multiple), r, tp) == 0).sum())


def vllm_expected(full: dict, r: int, tp: int, c: dict) -> dict:
    """vLLM TP rank r (the layout: `V pad 64 over tp`; qkv `(q: (Q, D) | k: (KV, D) | v: (KV, D)) over tp`:
    each part split over tp, k/v heads replicated when tp > KV (rank r holds head r*KV//tp); gate_up
    `(gate: F | up: F) over tp`; o_proj / down_proj split along dim 1)."""
    Q, KV, D, L = c["Q"], c["KV"], c["D"], c["L"]
    out = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        out[name] = block(padded_rows(full[name], 64), r, tp)
    out["model.norm.weight"] = full["model.norm.weight"]
    qh = Q // tp
    kv_first, kv_count = (r * KV // tp, 1) if tp > KV else (r * (KV // tp), KV // tp)
    for l in range(L):
        p = f"model.layers.{l}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = full[p + n]
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([
            heads(full[p + "self_attn.q_proj.weight"], r * qh, qh, D),
            heads(full[p + "self_attn.k_proj.weight"], kv_first, kv_count, D),
            heads(full[p + "self_attn.v_proj.weight"], kv_first, kv_count, D)])
        out[p + "self_attn.o_proj.weight"] = block(full[p + "self_attn.o_proj.weight"], r, tp, 1)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([block(full[p + "mlp.gate_proj.weight"], r, tp),
                                                        block(full[p + "mlp.up_proj.weight"], r, tp)])
        out[p + "mlp.down_proj.weight"] = block(full[p + "mlp.down_proj.weight"], r, tp, 1)
    return out


def megatron_expected(full: dict, r: int, tp: int, c: dict) -> dict:
    """Megatron TP rank r (`layoutc new megatron`): vocabulary padded to a multiple of 128*TP and split;
    linear_qkv `(KV, (q: QG*D | k: D | v: D)) over tp`: the rank's query groups, each its QG q heads,
    then its k head, then its v head; linear_fc1 = the rank's gate block, then its up block."""
    Q, KV, D, L = c["Q"], c["KV"], c["D"], c["L"]
    QG = Q // KV
    out = {}
    out["embedding.word_embeddings.weight"] = block(padded_rows(full["model.embed_tokens.weight"], 128 * tp), r, tp)
    out["output_layer.weight"] = block(padded_rows(full["lm_head.weight"], 128 * tp), r, tp)
    out["decoder.final_layernorm.weight"] = full["model.norm.weight"]
    for l in range(L):
        p, m = f"model.layers.{l}.", f"decoder.layers.{l}."
        out[m + "input_layernorm.weight"] = full[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = full[p + "post_attention_layernorm.weight"]
        groups = []
        for g in range(r * KV // tp, (r + 1) * KV // tp):
            groups += [heads(full[p + "self_attn.q_proj.weight"], g * QG, QG, D),
                       heads(full[p + "self_attn.k_proj.weight"], g, 1, D),
                       heads(full[p + "self_attn.v_proj.weight"], g, 1, D)]
        out[m + "self_attention.linear_qkv.weight"] = torch.cat(groups)
        out[m + "self_attention.linear_proj.weight"] = block(full[p + "self_attn.o_proj.weight"], r, tp, 1)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([block(full[p + "mlp.gate_proj.weight"], r, tp),
                                                      block(full[p + "mlp.up_proj.weight"], r, tp)])
        out[m + "mlp.linear_fc2.weight"] = block(full[p + "mlp.down_proj.weight"], r, tp, 1)
    return out


def megatron_to_hf(gathered: dict, c: dict, V: int) -> dict:
    """The HF state dict of Megatron weights gathered over TP (cat along each weight's split dim), by
    Megatron's rules: padded vocabulary cut to V, grouped qkv split per group, fc1 = [gate_r | up_r]
    per rank. `gathered[name]` is the list of the TP ranks' local tensors."""
    Q, KV, D, L, F = c["Q"], c["KV"], c["D"], c["L"], c["F"]
    QG = Q // KV
    cat0 = {n: torch.cat(parts) for n, parts in gathered.items()}
    out = {"model.embed_tokens.weight": cat0["embedding.word_embeddings.weight"][:V],
           "lm_head.weight": cat0["output_layer.weight"][:V],
           "model.norm.weight": gathered["decoder.final_layernorm.weight"][0]}
    for l in range(L):
        p, m = f"model.layers.{l}.", f"decoder.layers.{l}."
        out[p + "input_layernorm.weight"] = gathered[m + "input_layernorm.weight"][0]
        out[p + "post_attention_layernorm.weight"] = gathered[m + "pre_mlp_layernorm.weight"][0]
        qkv = cat0[m + "self_attention.linear_qkv.weight"].reshape(KV, QG + 2, D, -1)
        out[p + "self_attn.q_proj.weight"] = qkv[:, :QG].reshape(Q * D, -1)
        out[p + "self_attn.k_proj.weight"] = qkv[:, QG].reshape(KV * D, -1)
        out[p + "self_attn.v_proj.weight"] = qkv[:, QG + 1].reshape(KV * D, -1)
        out[p + "self_attn.o_proj.weight"] = torch.cat(gathered[m + "self_attention.linear_proj.weight"], 1)
        fc1 = gathered[m + "mlp.linear_fc1.weight"]
        f = F // len(fc1)
        out[p + "mlp.gate_proj.weight"] = torch.cat([t[:f] for t in fc1])
        out[p + "mlp.up_proj.weight"] = torch.cat([t[f:] for t in fc1])
        out[p + "mlp.down_proj.weight"] = torch.cat(gathered[m + "mlp.linear_fc2.weight"], 1)
    return {k: v.contiguous() for k, v in out.items()}


def read_checkpoint(folder: str) -> dict:
    """Every tensor of every *.safetensors file, read by the safetensors package."""
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def garbage(layout, rank: int) -> dict:
    """This rank's destination tensors of `layout`, by its local shapes and dtypes, all NaN."""
    return {t.name: torch.full(t.local_shape_at(rank), float("nan"), dtype=TORCH_DTYPE[t.dtype])
            for t in layout.tensors if t.holds(rank)}


def check_all(got: dict, want: dict, what: str) -> int:
    """Every destination tensor equals its expectation element by element; returns elements checked."""
    assert set(got) == set(want), f"{what}: tensors {sorted(set(got) ^ set(want))}"
    n = 0
    for name, w in want.items():
        assert not torch.isnan(w).any(), name
        assert got[name].shape == w.shape, f"{what}: {name} {tuple(got[name].shape)} vs {tuple(w.shape)}"
        assert torch.equal(got[name], w.to(got[name].dtype)), f"{what}: {name} differs"
        n += w.numel()
    return n


# ---- the cases ---------------------------------------------------------------------------------------

def case_load(job: dict, rank: int, report: dict) -> None:
    from layoutlang import load as load_layout
    from layoutlang.checkpoint import load
    from layoutlang.runtime.errors import RefitError

    c, group = job["llama"], dist.group.WORLD
    full = read_checkpoint(job["llama_dir"])
    rules = {"vllm": lambda r: vllm_expected(full, r, 2, c), "megatron": lambda r: megatron_expected(full, r, 2, c),
             "hf": lambda r: full}
    report["loaded"] = {}
    for kind, exchange in (("vllm", False), ("megatron", False), ("hf", False), ("vllm", True)):
        layout = load_layout(job["layouts"][kind], {})
        dst = garbage(layout, rank)
        got = load(job["llama_dir"], job["layouts"][kind], dst, rank=rank, group=group, exchange=exchange)
        want = rules[kind](rank)
        checked = check_all(dst, want, f"{kind} rank {rank}")
        # each rank reads its own elements only (padding is never read): every element but the
        # padded vocabulary rows, 2 vocabulary tensors of H columns in bf16
        pad = 0 if kind == "hf" else vocab_pad_rows(c["V"], {"vllm": 64, "megatron": 128 * 2}[kind], rank, 2)
        own = sum(w.numel() * 2 for w in want.values()) - 2 * pad * c["H"] * 2
        report["loaded"][f"{kind}{'_exchange' if exchange else ''}"] = {
            "checked": checked, "read_bytes": got.read_bytes, "own_bytes": own,
            "received_bytes": got.received_bytes}

    # a misshapen destination on rank 1: it fails naming the tensor and writes nothing; rank 0 fails too
    layout = load_layout(job["layouts"]["hf"], {})
    dst = garbage(layout, rank)
    if rank == 1:
        dst["model.layers.1.mlp.up_proj.weight"] = torch.full((c["F"] + 1, c["H"]), float("nan"),
                                                              dtype=torch.bfloat16)
    try:
        load(job["llama_dir"], layout, dst, rank=rank, group=group)
        report["bad_shape"] = {"raised": None}
    except RefitError as e:
        report["bad_shape"] = {"raised": type(e).__name__, "message": str(e),
                               "untouched": all(bool(torch.isnan(t).all()) for t in dst.values())}


def case_vllm_save(job: dict, rank: int, report: dict) -> None:
    """`layoutc new vllm` TP2 shards (loaded from the save_pretrained Llama) saved into a directory
    that does not exist yet, with no config.json anywhere near it and no `config=`: the q/k rows
    the layout writes as rotary halves meet the files' plain rows (layoutlang/compiler/refine.py)."""
    from layoutlang import load as load_layout
    from layoutlang.checkpoint import load, save

    layout = load_layout(job["layouts"]["vllm"], {})
    shards = garbage(layout, rank)
    load(job["llama_dir"], layout, shards, rank=rank, group=dist.group.WORLD)
    r = save(job["vllm_save"], layout, shards, group=dist.group.WORLD, max_shard_size="10KB")
    report["vllm_save"] = {"files": list(r.files), "written": r.written_bytes}


def _tokens(V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, V, (2, 12), generator=g)


def case_fsdp2_save(job: dict, rank: int, report: dict) -> None:
    import copy

    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from fsdp2_refit_program import V, config  # the tiny FSDP2 Llama of tests/test_bridge_dtensor.py
    from layoutlang import loads
    from layoutlang.bridges import dtensor, hf
    from layoutlang.checkpoint import load, save

    torch.manual_seed(0)
    trainer = LlamaForCausalLM(config()).float().eval()
    reference = copy.deepcopy(trainer)  # unsharded, for the expected files only
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for layer in trainer.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    # the HF bridge (its families write q/k rows as rotary halves, as the saved config.json makes the
    # files say), through the DTensor bridge's placements; before a forward: after one, FSDP2 leaves
    # the root's own parameters unsharded (plain tensors) until the next backward
    layout = loads(hf.describe(trainer), "<fsdp2>")
    out = job["fsdp2"]
    sizes = {}
    for kind, dtype in (("fp32", None), ("bf16", "bf16")):
        if rank == 0:
            os.makedirs(out[kind], exist_ok=True)
            reference.config.save_pretrained(out[kind])  # a non-checkpoint file in the target is fine
        dist.barrier()
        r = save(out[kind], layout, dtensor.tensors(trainer), group=dist.group.WORLD, max_shard_size="4KB",
                 dtype=dtype)
        sizes[kind] = {"files": list(r.files), "written": r.written_bytes}
        if rank == 0:
            ref = reference if dtype is None else copy.deepcopy(reference).to(torch.bfloat16)
            ref.save_pretrained(out[kind + "_ref"], max_shard_size="4KB")
    # and back: the reference's save_pretrained files loaded into a fresh FSDP2 model (other weights),
    # ragged shards (vocabulary 37 over 2: 19 and 18 rows); torch's own gather must give the files' tensors
    torch.manual_seed(1)
    fresh = LlamaForCausalLM(config()).float().eval()
    for layer in fresh.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    dist.barrier()  # rank 0 has written the reference files
    load(out["fp32_ref"], loads(hf.describe(fresh), "<fresh>"), dtensor.tensors(fresh),
         group=dist.group.WORLD)
    files = read_checkpoint(out["fp32_ref"])
    for name, p in fresh.named_parameters():
        assert torch.equal(p.full_tensor(), files[name]), f"FSDP2 load: {name} differs"
    report["fsdp2_load_checked"] = sum(t.numel() for t in files.values())
    tokens = _tokens(V)
    with torch.no_grad():
        logits = trainer(tokens).logits  # the FSDP2 trainer's own forward (every rank)
    if rank == 0:
        save_file({"tokens": tokens, "logits": logits.contiguous()}, out["logits"])
    report["fsdp2"] = sizes


def case_megatron_save(job: dict, rank: int, report: dict) -> None:
    from safetensors.torch import save_file

    import megatron_worker as mw  # tests/megatron_worker.py: the tiny Megatron GPT on CPU
    from layoutlang import loads
    from layoutlang.bridges import megatron as bridge
    from layoutlang.checkpoint import save

    s = mw.Scenario(world=2, tp=2, pp=1, ep=1, family="llama", tied=False)
    model = mw.build_megatron(s)
    layout = loads(bridge.describe(model, vocab_size=mw.V), "<megatron>")
    tokens = _tokens(mw.V)
    with torch.no_grad():
        full_logits, _ = mw.megatron_logits(model, tokens, s)
    # the reference: gather every weight over TP (torch's all_gather), un-fuse by Megatron's rules
    gathered = {}
    for name, p in model.named_parameters():
        parts = [torch.empty_like(p.data) for _ in range(2)]
        dist.all_gather(parts, p.data.contiguous())
        gathered[name] = parts
    c = {"Q": mw.Q, "KV": mw.KV, "D": mw.D, "L": s.layers, "F": mw.F}
    state = megatron_to_hf(gathered, c, mw.V)
    out = job["megatron"]
    hf = mw.build_hf(s)
    if rank == 0:
        hf.load_state_dict(state, strict=True)
        with torch.no_grad():
            mine = hf(tokens).logits
        report["megatron_ref_vs_megatron"] = (mine - full_logits).abs().max().item()
        hf.save_pretrained(out["ref"], max_shard_size="16KB")
        os.makedirs(out["dir"], exist_ok=True)
        hf.config.save_pretrained(out["dir"])
        save_file({"tokens": tokens, "logits": full_logits.contiguous()}, out["logits"])
    dist.barrier()
    r = save(out["dir"], layout, bridge.tensors(model), group=dist.group.WORLD, max_shard_size="16KB")
    report["megatron"] = {"files": list(r.files), "written": r.written_bytes, "exchanged": list(r.exchanged),
                          "transport": r.transport}
    if rank == 0:
        os.makedirs(out["in_place"], exist_ok=True)
        hf.config.save_pretrained(out["in_place"])
    dist.barrier()
    r = save(out["in_place"], layout, bridge.tensors(model), group=dist.group.WORLD, max_shard_size="16KB",
             exchange=False)
    report["megatron_in_place"] = {"written": r.written_bytes, "exchanged": list(r.exchanged)}
    from layoutlang.checkpoint import exchange

    if rank == 0:
        os.makedirs(out["rounds"], exist_ok=True)
        hf.config.save_pretrained(out["rounds"])
    dist.barrier()
    # over the links (not out of the peers' memory), every exchanged key in a round of its own
    default, exchange.ROUND_BYTES, exchange.MEMORY = exchange.ROUND_BYTES, 1, False
    try:
        r = save(out["rounds"], layout, bridge.tensors(model), group=dist.group.WORLD, max_shard_size="16KB")
        report["megatron_rounds"] = {"transport": r.transport}
    finally:
        exchange.ROUND_BYTES, exchange.MEMORY = default, True


MXFP8_SAVE = """
layout mx_save
mesh m (tp=2)
tensor w [64, 64 over tp] mxfp8
tensor u [96 over tp, 32] mxfp8
tensor big [256 over tp, 256] fp32
tensor rep [300, 128] fp32
"""


def mx_values() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole bf16 tensors of MXFP8_SAVE's mxfp8 keys (columns of very different scales; a zero block)."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 64, generator=g) * torch.logspace(-3, 2, 64)).to(torch.bfloat16)
    u = (torch.randn(96, 32, generator=g) * 3).to(torch.bfloat16)
    u[10] = 0
    return w, u


def plain_values() -> dict:
    """MXFP8_SAVE's fp32 keys, whole: `big` (128 KiB contiguous per rank) and `rep` (both ranks hold it)."""
    g = torch.Generator().manual_seed(6)
    return {"big": torch.randn(256, 256, generator=g), "rep": torch.randn(300, 128, generator=g)}


def case_mxfp8_save(job: dict, rank: int, report: dict) -> None:
    from reference_quant import quantize_mxfp8

    from layoutlang import loads
    from layoutlang.checkpoint import save

    w, u = mx_values()
    local = {"w": w[:, rank * 32:(rank + 1) * 32], "u": u[rank * 48:(rank + 1) * 48]}
    tensors = {}
    for name, t in local.items():
        ref = quantize_mxfp8(t.float().tolist())
        tensors[name] = (torch.tensor(ref.codes, dtype=torch.uint8).view(torch.float8_e4m3fn),
                         torch.tensor(ref.scales, dtype=torch.uint8))
    plain = plain_values()
    tensors["big"] = plain["big"][rank * 128:(rank + 1) * 128].clone()
    tensors["rep"] = plain["rep"].clone()
    save(job["mx"]["dir"], loads(MXFP8_SAVE, "<mx>"), tensors, group=dist.group.WORLD)
    report["mxfp8_save"] = True


FAIL_SAVE = """
layout fail_save
mesh m (tp=2)
tensor a [8 over tp, 4] fp32
tensor b [6, 4] fp32
"""


def _fail_tensors(rank: int) -> dict:
    return {"a": torch.arange(16, dtype=torch.float32).reshape(4, 4) + 16 * rank,
            "b": torch.arange(24, dtype=torch.float32).reshape(6, 4)}


def case_save_raises(job: dict, rank: int, report: dict) -> None:
    from layoutlang import loads
    from layoutlang.checkpoint import save, write

    real = write.write_pieces

    def broken(*a, **k):
        raise RuntimeError("injected failure in write_pieces")

    write.write_pieces = broken if rank == 0 else real
    try:
        save(job["fail_dir"], loads(FAIL_SAVE, "<fail>"), _fail_tensors(rank), group=dist.group.WORLD)
        report["save_raises"] = {"raised": None}
    except Exception as e:  # noqa: BLE001 - reported as data
        report["save_raises"] = {"raised": type(e).__name__, "message": str(e)}
    finally:
        write.write_pieces = real
    dist.barrier()


def case_save_killed(job: dict, rank: int, report: dict, out_path: str) -> None:
    from layoutlang import loads
    from layoutlang.checkpoint import save, write

    real = write.write_pieces

    def dies(*a, **k):
        real(*a, **k)  # its pieces are in the files: only the end of the save is missing
        report["killed"] = True
        report["ok"] = True
        Path(out_path).write_text(json.dumps(report))
        os._exit(1)

    if rank == 1:
        write.write_pieces = dies
    try:
        save(job["kill_dir"], loads(FAIL_SAVE, "<kill>"), _fail_tensors(rank), group=dist.group.WORLD)
        report["save_killed"] = {"raised": None}
    except Exception as e:  # noqa: BLE001 - reported as data
        report["save_killed"] = {"raised": type(e).__name__, "message": str(e)[:2000]}


def main() -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    report: dict = {}
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import warnings

        warnings.filterwarnings("ignore")
        job = json.loads(Path(job_path).read_text())
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["pg_timeout"]))
        rank = dist.get_rank()
        report["rank"] = rank
        case_load(job, rank, report)
        case_vllm_save(job, rank, report)
        case_fsdp2_save(job, rank, report)
        case_megatron_save(job, rank, report)
        case_mxfp8_save(job, rank, report)
        case_save_raises(job, rank, report)
        dist.barrier()
        report["ok"] = True  # the last case ends the group: rank 1 dies in it
        case_save_killed(job, rank, report, out_path)
    except BaseException as e:  # noqa: BLE001 - the test reads the reason from the report
        report.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(out_path).write_text(json.dumps(report))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report.get("ok") else 1)  # no process-group teardown with a dead peer


if __name__ == "__main__":
    main()
