#!/usr/bin/env bash
# The main job: set up, check every shipped layout, plan the Llama-3-8B refit
# (trainer TP8 x GTP2 x DP4 bf16 -> engine TP2 mxfp8), then refit a small
# model of the same structure across 8 real gloo processes on this CPU and
# check every destination element; then load a save_pretrained checkpoint
# into that trainer layout on 8 processes, save it back from the shards, and
# check every key and the logits through transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/layoutc check examples/*.layout examples/small/*.layout
.venv/bin/layoutc fmt --check examples/
.venv/bin/layoutc plan examples/llama3_8b_train.layout examples/llama3_8b_infer.layout
.venv/bin/layoutc run examples/small/llama_train.layout examples/small/llama_infer.layout --nproc 8 --verify
.venv/bin/python scripts/checkpoint_demo.py
