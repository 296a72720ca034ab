# tests/fuzz/build.sh - the one place that builds the libFuzzer targets; sourced (from
# the repository root) by tests/fuzz/run.sh (CI's short run) and benchmarks/fuzz.sh
# (the deep run). It compiles every tests/fuzz/fuzz_*.c with clang under libFuzzer,
# AddressSanitizer and UndefinedBehaviorSanitizer against csrc/core/*.c into
# $FUZZ_OUT/fuzz_<name>, writes the seed corpora (make_seeds.py) to $FUZZ_OUT/seeds/<name>,
# and sets:
#   FUZZ_OUT      the build directory: $FUZZ_BUILD, default /tmp/pyddp-fuzz
#   FUZZ_TARGETS  the target names (store wire ...)
#   FUZZ_FLAGS    the libFuzzer options every run uses (time and memory limits per input)
# FUZZ_CC overrides the compiler (default: clang, else the newest /usr/bin/clang-N).
# Needs clang with libFuzzer (Debian: apt-get install clang).
FUZZ_CC=${FUZZ_CC:-$(command -v clang || ls /usr/bin/clang-[0-9]* 2>/dev/null | sort -V | tail -1)}
if [ -z "$FUZZ_CC" ]; then echo "tests/fuzz/build.sh: no clang found (apt-get install clang)" >&2; exit 1; fi
FUZZ_OUT=${FUZZ_BUILD:-/tmp/pyddp-fuzz}
FUZZ_FLAGS=(-timeout=10 -rss_limit_mb=2048 -max_len=4096)
FUZZ_TARGETS=()
mkdir -p "$FUZZ_OUT"
python3 tests/fuzz/make_seeds.py "$FUZZ_OUT/seeds"
for src in tests/fuzz/fuzz_*.c; do
    t=$(basename "$src" .c); t=${t#fuzz_}
    "$FUZZ_CC" -std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer \
        -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
        -Icsrc/core -o "$FUZZ_OUT/fuzz_$t" "$src" csrc/core/*.c \
        -lpthread -lm -lrt -ldl
    FUZZ_TARGETS+=("$t")
done
