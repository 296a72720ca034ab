#!/usr/bin/env bash
# The README's test command: from a fresh clone on a fresh machine, make a virtual
# environment, install pyddp with its test extras (torch 2.13.0 CPU, pytest, Lightning,
# and the nvidia-nccl-cu13 wheel, whose nccl.h and libnccl.so.2 tests/test_nccl_real.py
# checks pyddp against without a GPU), then run the C unit tests (under ASan/UBSan, no
# Python) and the whole pytest suite.
# Usage: bash scripts/test.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYDDP_VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
echo "== C core unit tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
make -s -j"$(nproc)" -C tests/c check
echo "== Python tests"
"$VENV/bin/python" -m pytest -q "$@" tests
