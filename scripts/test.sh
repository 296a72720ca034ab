#!/usr/bin/env bash
# The README's test command: from a fresh clone on a fresh machine, make a virtual
# environment, install pyddp with its test extras (torch 2.13.0 CPU, pytest, Lightning,
# and the nvidia-nccl-cu13 wheel, whose nccl.h and libnccl.so.2 tests/test_nccl_real.py
# checks pyddp against without a GPU), then run the C unit tests (under ASan/UBSan, no
# Python) and the whole pytest suite.
#
# The whole suite runs in two pytest processes side by side: the tests that mostly wait
# out detection deadlines (multi-host and in-place elastic, etcd, straggler reports,
# exits; little CPU) in one, everything else in the other, the result-comparison tests
# first so that the tests that time their deadlines run once the machine is quieter.
# Each lane prints its own summary; the script fails if either fails.
# Usage: bash scripts/test.sh [extra pytest arguments]   (with arguments: one pytest
# process; without a path among them the whole tests/ folder runs)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYDDP_VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
echo "== C core unit tests (AddressSanitizer + UndefinedBehaviorSanitizer)"
make -s -j"$(nproc)" -C tests/c check
echo "== Python tests"
PYTEST=("$VENV/bin/python" -m pytest -q)
# pyproject.toml's testpaths make tests/ the default when no path is given
if [ $# -gt 0 ]; then exec "${PYTEST[@]}" "$@"; fi

SIDE=(tests/test_elastic.py tests/test_elastic_etcd.py tests/test_etcd_store.py
      tests/test_multivm.py tests/test_elastic_inplace.py tests/test_straggler.py
      tests/test_exits.py)
EARLY=(tests/test_torch_suite.py tests/test_ddp_join.py tests/test_collectives.py
       tests/test_transport.py tests/test_hier.py tests/test_ddp_numpy.py
       tests/test_ddp_parity.py tests/test_ddp_reduce_dtype.py tests/test_subgroups.py
       tests/test_accelerate.py tests/test_recv_any.py tests/test_sampler.py
       tests/test_lightning.py tests/test_examples.py tests/test_nccl_real.py
       tests/test_nccl_nogpu.py tests/test_nccl_lean.py tests/test_bench_plot.py)
MAIN=("${EARLY[@]}")
for f in tests/test_*.py; do
    case " ${SIDE[*]} ${EARLY[*]} " in *" $f "*) ;; *) MAIN+=("$f") ;; esac
done
MAIN+=(tests/gpu)

# The side lane in its own process group (setsid), so that an early exit kills it and
# every process its tests started.
SIDE_LOG=$(mktemp)
setsid "${PYTEST[@]}" -p no:cacheprovider "${SIDE[@]}" >"$SIDE_LOG" 2>&1 &
SIDE_PID=$!
trap 'kill -- -"$SIDE_PID" 2>/dev/null || true; rm -f "$SIDE_LOG"' EXIT
main_rc=0
"${PYTEST[@]}" "${MAIN[@]}" || main_rc=$?
side_rc=0
wait "$SIDE_PID" || side_rc=$?
echo "== Python tests, the waiting lane (${SIDE[*]})"
cat "$SIDE_LOG"
echo "== Python tests: main lane exit $main_rc, waiting lane exit $side_rc"
[ "$main_rc" -eq 0 ] && [ "$side_rc" -eq 0 ]
