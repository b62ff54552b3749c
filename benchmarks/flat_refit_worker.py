"""One rank of the flat-shard refit benchmark (benchmarks/flat_refit.py starts it; see there).

Run by `layoutlang.runtime.launch.launch(job, 6, program=__file__)` as
`python flat_refit_worker.py JOB.json OUT.json` (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Ranks 0..W-1 build a transformers Llama under `deepspeed.zero.Init` partitioned over their own
group (DeepSpeed 0.19, ZeRO-3 on gloo): every parameter flattened on its own, padded to a
multiple of W, rank r keeping `ds_tensor`; ranks W and W+1 hold vLLM's TP2 layout of the same
model (`layout_text(config, "vllm", TP=2, AT=W)`: q|k|v and gate|up packed per rank, the
vocabulary padded to 64 rows). Each round times, in a balanced order (refit_gloo.round_order),
one refit per method, between two barriers of all ranks (a step's time is the slowest rank's):

  layoutlang       `Refitter(plan, budget_bytes=B, steady=True)` over the ZeRO-3 bridge's
                   `describe()` / `tensors()` (the `ds_tensor`s themselves, no gather), the
                   default "auto" transport (shared memory between processes of one host)
  layoutlang_gloo  the same over transport="group" (gloo, the wire TRL's path uses here)
  trl              TRL's path, written here (trl `_move_model_to_vllm` under ZeRO-3): per
                   parameter, `deepspeed.zero.GatheredParameters([param])` on every ZeRO-3 rank;
                   inside it rank 0 broadcasts the whole tensor to the engine ranks (one
                   broadcast group: rank 0 and the engine ranks, as TRL's and OpenRLHF's
                   NCCL groups are); each engine rank receives it whole and keeps its slice by
                   vLLM's weight loaders (`vllm_slice`: QKVParallelLinear, MergedColumnParallel
                   Linear, RowParallelLinear, VocabParallelEmbedding with its zeroed padding)

Before every timed step the engine's tensors are filled with NaN; after it they must equal,
bit for bit, the reference each engine rank builds once, before timing, from the full
parameters that `GatheredParameters` gives (sent whole to the engine ranks, untimed) by vLLM's
rules written out as whole tensors (`vllm_expected`: the packed tensors concatenated), so a
method that writes a wrong or stale value, or none, fails the round.

Bytes a rank allocates beyond its own shards (accounted, not sampled): layoutlang's is its
Refitter's `meter.peak` (every staging buffer a step allocates, layoutlang/runtime/refit.py
`StagingMeter`), the largest over the rounds; TRL's, on a ZeRO-3 rank, the storage
`GatheredParameters` gives the parameter (`param.data.untyped_storage().nbytes()` inside the
context: DeepSpeed's all-gather buffer, padding included), the largest over the parameters;
on an engine rank, the whole tensor it receives into.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from refit_gloo import round_order  # noqa: E402

TP = 2
DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "fp32": (torch.float32, "float32")}


def config_dict(model: dict, dtype: str) -> dict:
    """The HF config.json of the benchmark's Llama (what `layout_text` and transformers read)."""
    return dict(model_type="llama", vocab_size=model["V"], hidden_size=model["H"], intermediate_size=model["F"],
                num_hidden_layers=model["L"], num_attention_heads=model["Q"], num_key_value_heads=model["KV"],
                head_dim=model["D"], rms_norm_eps=1e-6, tie_word_embeddings=False, dtype=DTYPES[dtype][1])


def padded_vocab(v: int) -> int:
    return -(-v // 64) * 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def vllm_slice(key: str, full: torch.Tensor, r: int, m: dict, dst: dict) -> None:
    """vLLM's weight loaders for Llama at TP2, rank r, one HF tensor at a time (what
    `LlamaForCausalLM.load_weights` does with each (name, tensor) TRL sends): write r's part of
    `full` into the packed tensor `dst` holds."""
    qd, kd, fd = m["Q"] // TP * m["D"], m["KV"] // TP * m["D"], m["F"] // TP
    stem, leaf = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
    if key in ("model.embed_tokens.weight", "lm_head.weight"):  # VocabParallelEmbedding / ParallelLMHead
        per = padded_vocab(m["V"]) // TP
        lo, hi = r * per, min((r + 1) * per, m["V"])
        out = dst[key]
        n = max(0, hi - lo)
        out[:n].copy_(full[lo:hi])
        out[n:].zero_()
        return
    if leaf in ("q_proj", "k_proj", "v_proj"):  # QKVParallelLinear: q rows, then k, then v
        rows = {"q_proj": (0, qd), "k_proj": (qd, kd), "v_proj": (qd + kd, kd)}[leaf]
        dst[f"{stem}.qkv_proj.weight"][rows[0]:rows[0] + rows[1]].copy_(full[r * rows[1]:(r + 1) * rows[1]])
    elif leaf in ("gate_proj", "up_proj"):  # MergedColumnParallelLinear: gate rows, then up
        at = 0 if leaf == "gate_proj" else fd
        dst[f"{stem}.gate_up_proj.weight"][at:at + fd].copy_(full[r * fd:(r + 1) * fd])
    elif leaf == "o_proj":  # RowParallelLinear: columns
        dst[key].copy_(full[:, r * qd:(r + 1) * qd])
    elif leaf == "down_proj":
        dst[key].copy_(full[:, r * fd:(r + 1) * fd])
    else:  # norms: whole on every rank
        dst[key].copy_(full)


def vllm_expected(full: dict, r: int, m: dict) -> dict:
    """What vLLM's TP rank r stores, as whole tensors (the packed ones concatenated), from the
    full weights: the reference, written apart from `vllm_slice`."""
    def rows(t, n):
        return t[r * n:(r + 1) * n]

    out = {}
    per = padded_vocab(m["V"]) // TP
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = torch.zeros(padded_vocab(m["V"]), m["H"], dtype=full[name].dtype)
        padded[:m["V"]] = full[name]
        out[name] = padded[r * per:(r + 1) * per]
    out["model.norm.weight"] = full["model.norm.weight"]
    qd, kd, fd = m["Q"] // TP * m["D"], m["KV"] // TP * m["D"], m["F"] // TP
    for layer in range(m["L"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = full[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = full[p + "post_attention_layernorm.weight"]
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([rows(full[p + "self_attn.q_proj.weight"], qd),
                                                          rows(full[p + "self_attn.k_proj.weight"], kd),
                                                          rows(full[p + "self_attn.v_proj.weight"], kd)])
        out[p + "self_attn.o_proj.weight"] = full[p + "self_attn.o_proj.weight"][:, r * qd:(r + 1) * qd]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([rows(full[p + "mlp.gate_proj.weight"], fd),
                                                        rows(full[p + "mlp.up_proj.weight"], fd)])
        out[p + "mlp.down_proj.weight"] = full[p + "mlp.down_proj.weight"][:, r * fd:(r + 1) * fd]
    return out


def _bytes_from(text: str | None, src: int) -> str:
    """Broadcast a string from rank `src` to every rank (a uint8 tensor; no pickle)."""
    data = torch.tensor(list(text.encode()) if text is not None else [], dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(n, src)
    buf = data if text is not None else torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src)
    return bytes(buf.tolist()).decode()


def build_zero3(m: dict, dtype: str, group, seed: int):
    """A transformers Llama under ZeRO-3 over `group` (zero.Init), its partitions filled with
    deterministic values (transformers' own init does not reach partitioned parameters) and
    the padding of each partition zero, as DeepSpeed leaves it."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    torch_dtype = DTYPES[dtype][0]
    cfg = config_dict(m, dtype)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "dtype")},
                         torch_dtype=torch_dtype)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                 "bf16": {"enabled": dtype == "bf16"}}
    # (the dtype comes from the config alone: DeepSpeed 0.19.8's `_set_dtype` turns an explicit
    # dtype into bf16 on a CPU without fp16, `dtype or fp16 if ... else bf16` as Python parses it)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, data_parallel_group=group):
        model = LlamaForCausalLM(config)
    if any(p.ds_tensor.dtype != torch_dtype for p in model.parameters()):
        raise RuntimeError(f"zero.Init partitioned in {next(model.parameters()).ds_tensor.dtype}, not {torch_dtype}")
    width, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed + rank)
    with torch.no_grad():
        for _, p in model.named_parameters():
            t = p.ds_tensor
            size = t.numel()
            data = max(0, min(size, p.ds_numel - rank * size))
            t.copy_(torch.randn(size, generator=g).to(t.dtype))
            t[data:].zero_()
    assert width == dist.get_world_size(group)
    return model


def _one_step(step) -> float:
    dist.barrier()
    t = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                    b.contiguous().view(torch.uint8))


def main(job: dict, rank: int) -> dict:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    # DeepSpeed's one JIT op (its CPU shared-memory allreduce) lives in the cache scripts/setup.sh
    # warms: .venv/torch_extensions
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    from layoutlang.bridges.families import layout_text
    from layoutlang.compiler import compile_plan
    from layoutlang.elaborate import loads
    from layoutlang.runtime import Refitter

    m, dtype, width = job["model"], job["dtype"], job["zero_ranks"]
    torch_dtype = DTYPES[dtype][0]
    timeout = timedelta(seconds=job["timeout"])
    torch.set_num_threads(1)
    zero_ranks, engines = list(range(width)), [width + i for i in range(TP)]
    zero_group = dist.new_group(zero_ranks, timeout=timeout)
    send_group = dist.new_group([0, *engines], timeout=timeout)  # TRL's: rank 0 and the engine ranks
    is_zero, is_engine = rank < width, rank in engines
    report: dict = {"rank": rank, "methods": {}}
    t0 = time.perf_counter()
    model = None
    if is_zero:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        from layoutlang.bridges import deepspeed as ds

        model = build_zero3(m, dtype, zero_group, seed=job.get("seed", 0))
        report["model_seconds"] = time.perf_counter() - t0  # DeepSpeed, transformers, zero.Init
        params = list(model.named_parameters())
        text = ds.describe(model)
        local = ds.tensors(model)
        assert all(local[n + ds.SUFFIX].data_ptr() == p.ds_tensor.data_ptr() for n, p in params)
        shards = sum(t.numel() * t.element_size() for t in local.values())
        report["deepspeed"] = deepspeed.__version__
    text = _bytes_from(text if rank == 0 else None, 0)
    shapes = json.loads(_bytes_from(json.dumps([[n, list(p.ds_shape)] for n, p in params]) if rank == 0 else None, 0))
    report["setup_seconds"] = time.perf_counter() - t0
    zero_layout = loads(text, path="<zero3>")
    vllm_layout = loads(layout_text(config_dict(m, dtype), "vllm", {"TP": TP, "AT": width}), path="<vllm tp2>")
    plan = compile_plan(zero_layout, vllm_layout)
    report["bytes"] = plan.stats["network_bytes"]
    dst = {}
    if is_engine:
        dst = {t.name: torch.full(t.local_shape_at(rank), float("nan"), dtype=torch_dtype)
               for t in vllm_layout.tensors if t.holds(rank)}
        shards = sum(t.numel() * t.element_size() for t in dst.values())
    if not (is_zero or is_engine):
        shards = 0
    report["shard_bytes"] = shards

    # The reference: the full parameters through DeepSpeed's own gather, sent whole, untimed
    reference = None
    full: dict = {}
    for name, shape in shapes:
        if is_zero:
            import deepspeed

            p = dict(params)[name]
            with deepspeed.zero.GatheredParameters([p]):
                if rank == 0:
                    dist.broadcast(p.data.contiguous(), 0, group=send_group)
        elif is_engine:
            buf = torch.empty(shape, dtype=torch_dtype)
            dist.broadcast(buf, 0, group=send_group)
            full[name] = buf
    if is_engine:
        r = rank - width
        reference = {n: t.contiguous() for n, t in vllm_expected(full, r, m).items()}
        assert sorted(reference) == sorted(dst), (sorted(reference), sorted(dst))
        report["reference_finite"] = all(bool(torch.isfinite(t).all()) for t in reference.values())
        full.clear()

    # The methods
    peaks: dict[str, int] = {}
    run = {}
    refitters = {}
    for method in job["methods"]:
        if method in ("layoutlang", "layoutlang_gloo"):
            refitter = Refitter(plan, budget_bytes=job["budget"], steady=True, timeout=timeout,
                                transport="auto" if method == "layoutlang" else "group")
            refitters[method] = refitter
            src = local if is_zero else None

            def step(refitter=refitter, src=src, method=method):
                refitter.refit(src, dst or None)
                peaks[method] = max(peaks.get(method, 0), refitter.meter.peak)
            run[method] = step
        elif method == "trl":
            run[method] = lambda: trl_step(rank, width, params if is_zero else None, shapes, send_group, dst, m,
                                           torch_dtype, peaks)
        else:
            raise ValueError(f"unknown method {method}")
    order = list(run)
    times = {k: [] for k in order}
    errors = {k: [] for k in order}
    last = None
    for i in range(1 + job["rounds"]):
        for method in round_order(order, i, last):
            for t in dst.values():
                t.fill_(float("nan"))
            seconds = _one_step(run[method])
            if i:  # round 0 warms every method up (and connects the Refitters' transports)
                times[method].append(seconds)
            if is_engine:
                wrong = [n for n, t in dst.items() if not _same(t, reference[n])]
                if wrong:
                    errors[method].append(f"round {i}: {len(wrong)} tensor(s) differ from the gathered parameters "
                                          f"by vLLM's rule, e.g. {wrong[0]}")
            last = method
    for method in order:
        report["methods"][method] = {"seconds": times[method], "errors": errors[method][:3],
                                     "peak_bytes": peaks.get(method, 0)}
    report["transports"] = {k: {str(p): c for p, c in r.transports.items()} for k, r in refitters.items()}
    report["staging_held"] = {k: r.staging_held for k, r in refitters.items()}
    report["replayed"] = {k: r.replayed for k, r in refitters.items()}
    for r in refitters.values():
        r.close()
    return report


def trl_step(rank: int, width: int, params, shapes, send_group, dst: dict, m: dict, torch_dtype, peaks: dict) -> None:
    """TRL's ZeRO-3 path (trl/trainer/grpo_trainer.py `_move_model_to_vllm`, OpenRLHF's
    `_broadcast_to_vllm` alike): per parameter, gather it on every ZeRO-3 rank; rank 0 sends the
    whole tensor to the engine ranks; each keeps its slice (`vllm_slice`)."""
    if params is not None:
        import deepspeed

        peak = peaks.get("trl", 0)
        for _, p in params:
            with deepspeed.zero.GatheredParameters([p]):
                peak = max(peak, p.data.untyped_storage().nbytes())  # DeepSpeed's gathered storage
                if rank == 0:
                    dist.broadcast(p.data, 0, group=send_group)
        peaks["trl"] = peak
    elif dst:
        r = rank - width
        peak = peaks.get("trl", 0)
        for name, shape in shapes:
            buf = torch.empty(shape, dtype=torch_dtype)
            peak = max(peak, buf.numel() * buf.element_size())
            dist.broadcast(buf, 0, group=send_group)
            vllm_slice(name, buf, r, m, dst)
        peaks["trl"] = peak


def _frame() -> int:
    job_path, out_path = sys.argv[1], sys.argv[2]
    job = json.loads(Path(job_path).read_text())
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=job["timeout"]))
        report = main(job, dist.get_rank())
        dist.barrier()
        report["ok"] = True
        code = 0
    except BaseException as exc:  # noqa: BLE001 - the launcher prints it
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        code = 1
    Path(out_path).write_text(json.dumps(report))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return code


if __name__ == "__main__":
    sys.exit(_frame())
