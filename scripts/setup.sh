#!/usr/bin/env bash
# Creates .venv (once) and installs layoutlang with its dev tools and the
# framework extras its bridge tests run against (megatron-core, transformers).
# torch is pinned to the local CPU build 2.13.0 through constraints.txt so pip
# never pulls a multi-GB CUDA wheel.
#
# megatron-core is pinned to 0.19.2 (constraints.txt), whose cp311 wheel declares
# Requires-Python >= 3.12 yet works on 3.11: pip would refuse it, so it goes in
# first with --no-deps --ignore-requires-python, and the normal install below then
# finds it installed and pulls its declared deps (numpy, packaging, torch). Its
# modules also import triton, which it does not declare: the version torch 2.13.0's
# own metadata pins (`triton==3.7.1` on Linux; the CPU wheel lists none). Nothing
# of this leaves this script: `pip install 'layoutlang[megatron]'` on Python 3.11
# resolves to megatron-core 0.16.1 (pyproject.toml). scripts/megatron_matrix.sh
# runs the Megatron bridge tests on that oldest supported release.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MCORE=$(grep -E '^megatron-core==' constraints.txt | cut -d= -f3)
TRITON=3.7.1   # torch 2.13.0's pin (Requires-Dist: triton==3.7.1); megatron-core imports it at module level
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat scripts/setup.sh pyproject.toml constraints.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt)
  "${pip[@]}" --no-deps --ignore-requires-python "megatron-core==$MCORE" "triton==$TRITON"
  "${pip[@]}" -e '.[dev,megatron,hf]'
  # verl (layoutlang.integrations.verl; pyproject's `verl` extra): --no-deps (it pins transformers<5.11
  # and a trainer's stack), then what importing its checkpoint engine and manager needs, and its
  # actor worker (verl.workers.engine_workers: datasets, pillow), whose update_weights the hook wraps
  "${pip[@]}" --no-deps "verl==$(grep -E '^verl==' constraints.txt | cut -d= -f3)"
  "${pip[@]}" tensordict omegaconf codetiming uvicorn fastapi pyzmq datasets pillow   # (ray: the line below)
  "${pip[@]}" ray   # the `ray` extra (layoutlang.integrations.ray, tests/test_ray_jobs.py), pinned in constraints.txt
  "${pip[@]}" nixl-cu12   # the `nixl` extra (runtime/transport_nixl.py, tests/test_transport_nixl.py), pinned in constraints.txt
  # the `deepspeed` extra (layoutlang/bridges/deepspeed.py, tests/test_bridge_deepspeed.py), pinned in
  # constraints.txt: no op prebuilt; its setup.py imports torch, so no build isolation
  DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation deepspeed
  rm -f .venv/.installed-*
  touch "$stamp"
fi
# DeepSpeed's one JIT op on CPU (the shared-memory allreduce its comm backend loads when it starts,
# ~70 s to compile), built once into the cache this script owns; tests point TORCH_EXTENSIONS_DIR
# there (tests/deepspeed_zero3_program.py). A built op loads in well under a second.
if ! ls .venv/torch_extensions/deepspeed_shm_comm/*.so >/dev/null 2>&1; then
  TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions" .venv/bin/python -c \
    "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
fi
