#!/usr/bin/env bash
# tests/fuzz/run.sh [SECONDS] - build the libFuzzer targets (clang, with AddressSanitizer
# and UndefinedBehaviorSanitizer) against the C core and run each for SECONDS (default
# 20) from a seed corpus of valid inputs (make_seeds.py). Exits non-zero, printing the
# crash and the input that caused it, on the first finding. Needs clang with libFuzzer
# (Debian: apt-get install clang); FUZZ_CC overrides the compiler, FUZZ_BUILD the
# directory (default /tmp/pyddp-fuzz). Targets: fuzz_store.c (the store server's request
# handling), fuzz_wire.c (hello, collective header, handshake readers).
set -euo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-20}
CC=${FUZZ_CC:-$(command -v clang || ls /usr/bin/clang-[0-9]* 2>/dev/null | sort -V | tail -1)}
if [ -z "$CC" ]; then echo "tests/fuzz/run.sh: no clang found (apt-get install clang)"; exit 1; fi
OUT=${FUZZ_BUILD:-/tmp/pyddp-fuzz}
mkdir -p "$OUT"
python3 tests/fuzz/make_seeds.py "$OUT/seeds"
for t in store wire; do
    "$CC" -std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer \
        -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
        -Icsrc/core -o "$OUT/fuzz_$t" "tests/fuzz/fuzz_$t.c" csrc/core/*.c \
        -lpthread -lm -lrt -ldl
    mkdir -p "$OUT/corpus_$t"
    cp "$OUT/seeds/$t"/* "$OUT/corpus_$t/"
    echo "== fuzz_$t for ${SECS} s"
    if ! "$OUT/fuzz_$t" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 \
            -max_len=4096 -artifact_prefix="$OUT/crash_$t-" -print_final_stats=1 \
            "$OUT/corpus_$t" > "$OUT/fuzz_$t.log" 2>&1; then
        tail -60 "$OUT/fuzz_$t.log"
        echo "fuzz_$t found a crash: input in $OUT/crash_$t-*"
        exit 1
    fi
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$OUT/fuzz_$t.log" | tr '\n' ' '
    echo
done
echo "fuzzing: no findings"
