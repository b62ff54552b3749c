#!/usr/bin/env bash
# The main job: set up, then check every shipped example layout and show the
# summary of the Llama-3-8B trainer layout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/layoutc check examples/*.layout
.venv/bin/layoutc fmt --check examples/
