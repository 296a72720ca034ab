#!/usr/bin/env bash
# tests/gpu/check.sh - build pyddp, run its GPU tests on a machine with an NVIDIA GPU, then
# the GPU benchmark (benchmarks/gpu.py: the cost per call and per DDP step beside torch's
# "nccl"), and print a summary. Finishes within 8 minutes on one GPU.
#
#   tests/gpu/check.sh               # uses $PYTHON, else python3
#   tests/gpu/check.sh --no-bench    # the tests only (within 5 minutes)
#
# Needs: a CUDA driver, torch with CUDA, and NCCL (the nvidia-nccl-cu12/cu13 wheel that
# torch installs is found automatically; PYDDP_NCCL_LIBRARY overrides). CuPy is used when
# installed. Tests that cannot run here are skipped and listed with the reason.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
BENCH=1
[ "${1:-}" = "--no-bench" ] && BENCH=0
LOG=$(mktemp -t pyddp-gpu-check.XXXXXX)
trap 'rm -f "$LOG"' EXIT
START=$(date +%s)

section() { printf '\n== %s\n' "$1"; }

section "machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1 \
    || echo "nvidia-smi not available"
"$PY" - <<'PYEOF' 2>&1
import sys
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
except ImportError:
    print("torch not installed")
try:
    import cupy
    print("cupy", cupy.__version__)
except ImportError:
    print("cupy not installed (CuPy tests will be skipped)")
PYEOF

section "build"
if ! timeout 240 "$PY" setup.py build_ext --inplace -q >"$LOG" 2>&1; then
    tail -30 "$LOG"
    echo "SUMMARY: build FAILED"
    exit 1
fi
echo "built in $(( $(date +%s) - START )) s"

section "NCCL discovery"
"$PY" - <<'PYEOF' 2>&1
import sys
import pyddp._nccl_backend as nb
if nb.usable():
    for k, v in nb.load().items():
        print(f"{k:16} {v}")
else:
    print("NOT USABLE:", nb.why_unusable())
    sys.exit(3)
PYEOF
USABLE=$?

section "tests"
LEFT=$(( 290 - ($(date +%s) - START) ))
timeout "$LEFT" "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu tests/test_nccl_nogpu.py \
    2>&1 | tee "$LOG"
RC=${PIPESTATUS[0]}

BRC=0
if [ "$BENCH" -eq 1 ] && [ "$USABLE" -eq 0 ]; then
    section "benchmark (benchmarks/gpu.py)"
    timeout 200 "$PY" benchmarks/gpu.py 2>&1
    BRC=$?
fi

section "summary"
echo "elapsed: $(( $(date +%s) - START )) s"
[ "$BENCH" -eq 1 ] && [ "$USABLE" -eq 0 ] && echo "benchmark: exit $BRC"
grep -E "^SKIPPED" "$LOG" | sed 's/^/  /' | cut -c1-160
LAST=$(grep -E "(passed|failed|error|skipped)" "$LOG" | tail -1)
if [ "$RC" -eq 0 ] && [ "$USABLE" -ne 0 ]; then
    echo "SUMMARY: NO GPU - the GPU tests were skipped (see NCCL discovery); $LAST"
    RC=3
elif [ "$RC" -eq 0 ]; then
    echo "SUMMARY: OK - $LAST"
elif [ "$RC" -eq 124 ]; then
    echo "SUMMARY: TIMED OUT after ${LEFT} s - $LAST"
else
    echo "SUMMARY: FAILED (pytest exit $RC) - $LAST"
fi
exit "$RC"
