#!/usr/bin/env bash
# Set up, then run the whole test suite (unit, property, golden, fuzz, the torchtitan
# bridge's tests (torchtitan in .venv: scripts/setup_torchtitan.sh), and the vLLM
# backend's tests, which run under .venv-vllm: scripts/setup_vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_torchtitan.sh
bash scripts/setup_vllm.sh
exec .venv/bin/python -m pytest -q --durations=25 "$@"
