#!/usr/bin/env bash
# The README's test command: from a fresh clone on a fresh machine, make a virtual
# environment, install pyddp with its test extras (torch 2.13.0 CPU, pytest, Lightning,
# and the nvidia-nccl-cu13 wheel, whose nccl.h and libnccl.so.2 tests/test_nccl_real.py
# checks pyddp against without a GPU), then run the C unit tests (no Python; under
# ASan/UBSan, then under ThreadSanitizer) and the whole pytest suite.
#
# Two lanes run side by side. The main lane is one pytest process with most of the
# suite, the result-comparison tests first so that the tests that time their deadlines
# run once the machine is quieter. The waiting lane runs the C unit tests, then a second
# pytest process with the tests that mostly wait out detection deadlines (multi-host and
# in-place elastic, etcd, straggler reports, exits; little CPU). Each lane prints its
# own summary; the script fails if either fails.
# Usage: bash scripts/test.sh [extra pytest arguments]   (with arguments: one pytest
# process; without a path among them the whole tests/ folder runs)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PYDDP_VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
PYTEST=("$VENV/bin/python" -m pytest -q)
c_tests() {
    echo "== C core unit tests (AddressSanitizer + UndefinedBehaviorSanitizer, then ThreadSanitizer)"
    make -s -j"$(nproc)" -C tests/c check tsan
}
export -f c_tests   # the waiting lane's shell below runs it too
if [ $# -gt 0 ]; then
    c_tests
    echo "== Python tests"
    # pyproject.toml's testpaths make tests/ the default when no path is given
    exec "${PYTEST[@]}" "$@"
fi

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

# The waiting lane in its own process group (setsid), so that an early exit kills it and
# every process its tests started. Its C tests use about one core while the main lane's
# first tests start their ranks; its pytest process runs whether or not they passed.
SIDE_LOG=$(mktemp)
setsid bash -c 'c_rc=0; c_tests || c_rc=$?; echo "== C unit tests exit $c_rc"
                echo "== Python tests, the waiting lane"
                py_rc=0; "$@" || py_rc=$?
                [ "$c_rc" -eq 0 ] && [ "$py_rc" -eq 0 ]' side \
    "${PYTEST[@]}" -p no:cacheprovider "${SIDE[@]}" >"$SIDE_LOG" 2>&1 &
SIDE_PID=$!
trap 'kill -- -"$SIDE_PID" 2>/dev/null || true; rm -f "$SIDE_LOG"' EXIT
echo "== Python tests, the main lane"
main_rc=0
"${PYTEST[@]}" "${MAIN[@]}" || main_rc=$?
side_rc=0
wait "$SIDE_PID" || side_rc=$?
echo "== The waiting lane: C unit tests, then ${SIDE[*]}"
cat "$SIDE_LOG"
echo "== Main lane exit $main_rc, waiting lane exit $side_rc"
[ "$main_rc" -eq 0 ] && [ "$side_rc" -eq 0 ]
