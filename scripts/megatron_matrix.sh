#!/usr/bin/env bash
# The Megatron bridge on the OLDEST supported megatron-core, in one command:
#   bash scripts/megatron_matrix.sh [pytest args]
# CI (.venv, scripts/setup.sh) tests the newest, 0.19.2; this builds .venv-mcore016
# (once; again when this script, pyproject.toml or constraints.txt change) with
# megatron-core 0.16.1 and everything else as .venv pins it (torch 2.13.0 CPU,
# transformers), then runs the Megatron bridge tests there. 0.16.1 installs the
# ordinary way on Python 3.11 (no --ignore-requires-python, no triton). Tests that
# need a newer release (tests/test_bridge_megatron_mla.py: MLA and grouped GEMM on
# the local spec, 0.19) skip themselves and say so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MCORE_VENV:-.venv-mcore016}
OLDEST=0.16.1
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
constraints="$VENV/constraints-mcore.txt"
stamp=$VENV/.installed-$(cat scripts/megatron_matrix.sh pyproject.toml constraints.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  # constraints.txt with the megatron-core pin moved to the oldest release
  sed -E "s/^megatron-core==.*/megatron-core==$OLDEST/" constraints.txt > "$constraints"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" -e '.[dev,megatron,hf]'
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
"$VENV/bin/python" -c "import megatron.core as m; print('megatron-core', m.__version__)"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=10 tests/test_bridge_megatron.py \
  tests/test_bridge_megatron_mla.py "$@"
