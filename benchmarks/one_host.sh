#!/bin/sh
# benchmarks/one_host.sh - pyddp against torch's gloo, ranks on this host, in one run
# each: first with shared memory (the default), then with PYDDP_SHM_DISABLE=1 (TCP over
# loopback). Prints pyddp.bench's tables (nccl-tests' columns, both backends side by
# side, interleaved rounds, ratio of bus bandwidths).
#
#   benchmarks/one_host.sh                 # 2 ranks, 8 B .. 256 MiB, all collectives
#   MAX=64M NPROC=2 benchmarks/one_host.sh --ops all_reduce
#
# Environment: PYTHON (default: python), NPROC (2), MAX (256M); extra arguments go to
# pyddp.bench.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for disable in 0 1; do
    echo "## PYDDP_SHM_DISABLE=$disable"
    PYDDP_SHM_DISABLE=$disable "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node="${NPROC:-2}" -m pyddp.bench --compare-gloo -e "${MAX:-256M}" "$@"
done
