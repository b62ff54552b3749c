#!/usr/bin/env bash
# Installs torchtitan 0.3.0 into .venv (made by scripts/setup.sh) for the torchtitan bridge
# tests (tests/test_bridge_torchtitan.py), once: a stamp records what was installed.
#
# torchtitan's wheel declares a trainer's dependencies (torchdata, torch_checkpointing,
# datasets, tensorboard, wandb, pillow, einops, ...): none of them is imported when a
# model is built, sharded (FSDP2, TP) and converted (StateDictAdapter) on CPU. So the
# wheel goes in with --no-deps, beside only what those imports reach, found by running
# them (python -X importtime): spmd_types (pinned by torchtitan, imported by its
# attention and parallel dims; itself needs torch, numpy, safetensors, typing_extensions,
# all in .venv) and tyro (torchtitan.config imports it; its own small dependencies come
# with it). Every pip call takes -c constraints.txt: torch stays the local CPU 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "setup_torchtitan.sh: run scripts/setup.sh first (it makes .venv)" >&2
  exit 1
fi
stamp=.venv/.torchtitan-$(cat scripts/setup_torchtitan.sh constraints.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
  "${pip[@]}" --no-deps torchtitan==0.3.0 spmd_types==0.2.3
  "${pip[@]}" "tyro>=0.9"
  .venv/bin/python -c "import torchtitan.models.llama3, torchtitan.models.qwen3, torchtitan.models.deepseek_v3"
  rm -f .venv/.torchtitan-*
  touch "$stamp"
fi
