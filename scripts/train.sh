#!/usr/bin/env bash
# The README's main job: from a fresh clone, make a virtual environment, install pyddp
# with torch 2.13.0 (CPU), and train examples/train.py under stock torchrun on 2
# processes with a synthetic dataset the script makes itself.
# Usage: bash scripts/train.sh [--nproc N] [train.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYDDP_VENV:-.venv}
PYTHON=${PYTHON:-python3}
NPROC=2
if [ "${1:-}" = "--nproc" ]; then NPROC=$2; shift 2; fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[examples]"
exec "$VENV/bin/torchrun" --standalone --nproc_per_node="$NPROC" examples/train.py "$@"
