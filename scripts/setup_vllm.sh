#!/usr/bin/env bash
# Creates .venv-vllm (once): vLLM 0.33 on CPU, for the vLLM weight-transfer tests
# (tests/vllm_models.py builds tiny vLLM models there). Separate from .venv because vLLM
# pins transformers<5.21 while the main venv's HF bridge tests run transformers 5.24.
#
# vLLM's PyPI wheel is the CUDA build and asks for torch==2.14.0 plus ~70 packages (CUDA
# kernels, serving, multimodal). It goes in with --no-deps; what follows is only what
# `import vllm` and building a model on CPU (VLLM_TARGET_DEVICE=cpu, EngineArgs ->
# VllmConfig, gloo world, model loader) import, found by running them. torch stays the
# local CPU build 2.13.0: every pip call here takes -c scripts/constraints-vllm.txt.
# The wheel's CPU kernels (vllm._C) are absent: tests/vllm_models.py defines the few ops
# model construction looks up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VLLM_VENV:-.venv-vllm}
C=scripts/constraints-vllm.txt

# constraints-vllm.txt must pin the same torch as constraints.txt
if [ "$(grep -E '^torch==' constraints.txt)" != "$(grep -E '^torch==' "$C")" ]; then
  echo "setup_vllm.sh: torch pins differ between constraints.txt and $C" >&2
  exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.installed-$(cat scripts/setup_vllm.sh pyproject.toml "$C" | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$C")
  "${pip[@]}" torch
  # vLLM's runtime dependencies on the CPU import / model-building path:
  deps=(
    # general: version checks, configs, hashing of configs (cbor2, blake3), system info
    packaging numpy regex cachetools psutil py-cpuinfo requests tqdm filelock
    typing_extensions pyyaml pydantic cbor2 blake3 pybase64 cloudpickle einops
    # vllm.v1 engine/IPC modules imported by the config and worker code (msgspec
    # structs, zmq sockets, uvloop in vllm.v1.utils, prometheus metrics in v1.metrics)
    msgspec pyzmq uvloop prometheus_client
    # models and their checkpoints: HF configs (transformers<5.21 via constraints),
    # safetensors for the tests' state dicts
    transformers huggingface_hub tokenizers safetensors
    # every linear/MoE layer's quantization registry imports compressed_tensors
    # (vLLM pins 0.17.0); it needs only torch, transformers, pydantic, loguru
    compressed-tensors==0.17.0
    # imported at module level along EngineArgs' import chain, though unused on this
    # path: multimodal hashing (pillow), the OpenAI-compatible server and its parsers
    # (fastapi, openai, aiohttp, partial_json_parser, oss-harmony = module
    # openai_harmony; not the older openai-harmony 0.0.8), structured output
    # (llguidance, xgrammar below)
    pillow fastapi openai aiohttp partial_json_parser oss-harmony llguidance
    # vLLM's own trainer-side clients (tests/test_vllm_clients.py): RayVLLMWeightSyncClient
    # drives engines in Ray actors (ray core only, no dashboard extras);
    # HTTPVLLMWeightSyncClient posts to vLLM's RL routes, served by uvicorn as `vllm serve`
    # serves them
    ray uvicorn
    # the main repo, its dev tools, no framework extras (no megatron-core, and no hf
    # extra: transformers comes pinned above)
    -e '.[dev]'
  )
  "${pip[@]}" "${deps[@]}"
  # xgrammar is imported by vllm.parser at module level; its declared deps include
  # triton (~1 GB, useless on CPU; its presence makes vLLM probe for GPU drivers), so
  # it goes in without them, plus the one it does import (apache-tvm-ffi).
  "${pip[@]}" --no-deps xgrammar apache-tvm-ffi==0.1.11
  # Always pinned and --no-deps: a plain `pip install vllm` here resolves vLLM's own
  # torch pin against the machine's torch cap and silently installs vllm 0.30.0 instead,
  # with triton, torchvision and ~90 more packages.
  "${pip[@]}" --no-deps vllm==0.33.0
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
