#!/usr/bin/env bash
# tests/fuzz/run.sh [SECONDS] - CI's short fuzz run: build the libFuzzer targets
# (tests/fuzz/build.sh: clang, AddressSanitizer, UndefinedBehaviorSanitizer, against the
# C core) and run each for SECONDS (default 20) from a seed corpus of valid inputs
# (make_seeds.py). Exits non-zero, printing the crash and the input that caused it, on
# the first finding. FUZZ_CC overrides the compiler, FUZZ_BUILD the directory (default
# /tmp/pyddp-fuzz). Targets: fuzz_store.c (the store server's request handling),
# fuzz_store_auth.c (a store server with a token: its handshake, then requests),
# fuzz_wire.c (hello, collective header, handshake readers). benchmarks/fuzz.sh runs the
# same targets for a million executions each.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-20}
source tests/fuzz/build.sh
OUT=$FUZZ_OUT
for t in "${FUZZ_TARGETS[@]}"; do
    mkdir -p "$OUT/corpus_$t"
    cp "$OUT/seeds/$t"/* "$OUT/corpus_$t/"
    echo "== fuzz_$t for ${SECS} s"
    if ! "$OUT/fuzz_$t" -max_total_time="$SECS" "${FUZZ_FLAGS[@]}" \
            -artifact_prefix="$OUT/crash_$t-" -print_final_stats=1 \
            "$OUT/corpus_$t" > "$OUT/fuzz_$t.log" 2>&1; then
        tail -60 "$OUT/fuzz_$t.log"
        echo "fuzz_$t found a crash: input in $OUT/crash_$t-*"
        exit 1
    fi
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$OUT/fuzz_$t.log" | tr '\n' ' '
    echo
done
echo "fuzzing: no findings"
