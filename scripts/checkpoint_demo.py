"""The main job's checkpoint part: an HF checkpoint loaded into a TP x GTP x DP trainer layout on
8 gloo processes, saved back from those shards, and read by transformers.

1. transformers builds a tiny Llama of examples/small's sizes (H 128, 16 heads, 2 KV heads,
   vocabulary 900, 2 layers; bf16) and `save_pretrained`s it in several files with an index;
2. 8 processes each `layoutlang.checkpoint.load` their shards of
   examples/small/llama_train.layout (fused grouped qkv, gate|up, `chunk gtp`, the padded
   vocabulary) straight from the files, then `save` the same layout to a new directory,
   each byte written by one of them;
3. here: every key of the saved files equals the original's (safe_open), and
   `from_pretrained` of the saved checkpoint gives the logits of `from_pretrained` of the original.

    python scripts/checkpoint_demo.py [--keep DIR]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

LAYOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "small", "llama_train.layout")


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=16, num_key_value_heads=2,
                         head_dim=8, num_hidden_layers=2, vocab_size=900, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def worker() -> None:
    """One of the 8 ranks (run by the launcher as `python checkpoint_demo.py JOB OUT`)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from bridge_program import run

    def body(job, rank):
        import torch
        import torch.distributed as dist

        from layoutlang import load as load_layout
        from layoutlang.checkpoint import load, save

        layout = load_layout(job["layout"])
        tensors = {t.name: torch.full(t.local_shape_at(rank), float("nan"), dtype=torch.bfloat16)
                   for t in layout.tensors if t.holds(rank)}
        start = time.perf_counter()
        got = load(job["ckpt"], layout, tensors, group=dist.group.WORLD)
        loaded = time.perf_counter() - start
        start = time.perf_counter()
        # the model's config says the q/k rows are rotary halves (as the layout writes them)
        done = save(job["out"], layout, tensors, group=dist.group.WORLD, max_shard_size="200KB",
                    config=os.path.join(job["ckpt"], "config.json"))
        return {"read": got.read_bytes, "written": done.written_bytes, "load_s": loaded,
                "save_s": time.perf_counter() - start}

    run(body)


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from layoutlang.runtime.launch import launch

    keep = argv[argv.index("--keep") + 1] if "--keep" in argv else None
    root = keep or tempfile.mkdtemp(prefix="layoutlang-ckpt-")
    ckpt, out = os.path.join(root, "hf"), os.path.join(root, "saved")
    model = _model()
    model.save_pretrained(ckpt, max_shard_size="200KB")
    files = sorted(n for n in os.listdir(ckpt) if n.endswith(".safetensors"))
    print(f"checkpoint {ckpt}: {len(files)} files (save_pretrained, max_shard_size 200KB)")
    job = {"ckpt": ckpt, "out": out, "layout": os.path.abspath(LAYOUT)}
    results = launch(job, 8, program=os.path.abspath(__file__), timeout=240)
    bad = [r for r in results if not r.ok]
    if bad:
        for r in bad:
            print(f"rank {r.rank}: {r.error}\n{(r.result or {}).get('trace', r.stderr[-2000:])}", file=sys.stderr)
        return 1
    res = [r.result for r in results]
    print(f"load into {os.path.relpath(LAYOUT)} on 8 gloo ranks: {sum(r['read'] for r in res)} bytes copied out of "
          f"the files, slowest rank {max(r['load_s'] for r in res):.3f} s")
    print(f"save from the 8 ranks' shards: {sum(r['written'] for r in res)} bytes written "
          f"(per rank {min(r['written'] for r in res)}-{max(r['written'] for r in res)}), slowest rank "
          f"{max(r['save_s'] for r in res):.3f} s")
    mismatched, keys = [], 0
    index = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    saved_index = json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"]
    if set(index) != set(saved_index):
        print(f"keys differ: {sorted(set(index) ^ set(saved_index))[:5]}", file=sys.stderr)
        return 1
    for key, file in index.items():
        with safe_open(os.path.join(ckpt, file), "pt") as a, safe_open(os.path.join(out, saved_index[key]), "pt") as b:
            keys += 1
            if not torch.equal(a.get_tensor(key), b.get_tensor(key)):
                mismatched.append(key)
    if mismatched:
        print(f"{len(mismatched)} keys differ from the original: {mismatched[:5]}", file=sys.stderr)
        return 1
    shutil.copy(os.path.join(ckpt, "config.json"), out)  # the model's config is the caller's, not a layout's
    ids = torch.tensor([[1, 5, 42, 7, 899, 3]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()(ids).logits
    if not torch.equal(want, got):
        print(f"logits differ: max |diff| {(want - got).abs().max().item()}", file=sys.stderr)
        return 1
    print(f"saved checkpoint {out}: {keys} keys equal to the original's bit for bit; "
          "from_pretrained gives the original's logits: ok")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1].endswith(".json"):
        worker()
    else:
        sys.exit(main(sys.argv[1:]))
