#!/usr/bin/env bash
# Creates .venv (once) and installs layoutlang with its dev tools and the
# framework extras its bridge tests run against (megatron-core, transformers).
# torch is pinned to the local CPU build 2.13.0 through constraints.txt so pip
# never pulls a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,megatron,hf]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi
