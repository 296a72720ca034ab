#!/usr/bin/env bash
# benchmarks/fuzz.sh [RUNS] - fuzzing at depth: the libFuzzer targets of CI's short run
# (tests/fuzz/run.sh; built by tests/fuzz/build.sh with AddressSanitizer and
# UndefinedBehaviorSanitizer against the C core), each run for RUNS executions (default
# 1000000) in one process, one target after another. The corpus each target grows is
# kept in a directory, so running it again starts where the last run got to and goes
# deeper. Prints per target: executions, executions per second (over the wall time), wall
# time, coverage and corpus (cov: edges, ft: features, corp: inputs/bytes, from
# libFuzzer's final line), peak RSS, and findings (crashes, leaks, timeouts,
# out-of-memory: count and the inputs' paths); then a summary line. Exits 1 if anything
# was found. libFuzzer stops a target at its first finding; the error is in the target's
# log, and the build directory's fuzz_NAME run on the input reproduces it.
#
#   bash benchmarks/fuzz.sh                  # 10^6 executions per target
#   FUZZ_RUNS=10000000 bash benchmarks/fuzz.sh
#
# Environment: FUZZ_RUNS (the default for RUNS), FUZZ_CORPUS (the kept corpora, logs and
# findings; default $FUZZ_BUILD/deep), FUZZ_BUILD and FUZZ_CC as for tests/fuzz/run.sh.
# Needs clang with libFuzzer (Debian: apt-get install clang).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-${FUZZ_RUNS:-1000000}}
source tests/fuzz/build.sh
DIR=${FUZZ_CORPUS:-$FUZZ_OUT/deep}
mkdir -p "$DIR"

# the value of "stat::NAME:" in a libFuzzer log (empty if absent)
stat_of() { sed -n "s/^stat::$2: *//p" "$1" | tail -1; }
# the value after "KEY: " on the log's last status line ("#N DONE cov: ... ft: ...")
final() { grep -E '^#[0-9]+' "$1" | tail -1 | sed -n "s/.* $2: \([^ ]*\).*/\1/p"; }

total_execs=0 total_found=0 found_in=()
for t in "${FUZZ_TARGETS[@]}"; do
    corpus=$DIR/corpus_$t finds=$DIR/findings_$t log=$DIR/fuzz_$t.log
    mkdir -p "$corpus" "$finds"
    cp -n "$FUZZ_OUT/seeds/$t"/* "$corpus/"
    stamp=$DIR/.started_$t
    touch "$stamp"
    echo "== fuzz_$t: $RUNS executions from $(ls "$corpus" | wc -l) corpus inputs"
    start=$(date +%s.%N)
    rc=0
    "$FUZZ_OUT/fuzz_$t" -runs="$RUNS" "${FUZZ_FLAGS[@]}" -artifact_prefix="$finds/" \
        -print_final_stats=1 "$corpus" > "$log" 2>&1 || rc=$?
    wall=$(echo "$start $(date +%s.%N)" | awk '{printf "%.1f", $2 - $1}')
    execs=$(stat_of "$log" number_of_executed_units)
    artifacts=$(find "$finds" -type f -newer "$stamp" | sort)
    n=0
    for kind in crash leak timeout oom; do
        k=$(printf '%s\n' "$artifacts" | grep -c "/$kind-" || true)
        n=$((n + k))
    done
    [ "$rc" -ne 0 ] && [ "$n" -eq 0 ] && n=1   # a failure that left no input
    rate=$(awk -v e="${execs:-0}" -v w="$wall" 'BEGIN {printf "%.0f", (w > 0 ? e / w : 0)}')
    cov=$(final "$log" cov) ft=$(final "$log" ft) corp=$(final "$log" corp)
    printf 'fuzz_%s: executions %s, exec/s %s, wall %s s, cov: %s ft: %s, corp: %s (%s files kept), peak RSS %s MB, findings %s\n' \
        "$t" "${execs:--}" "$rate" "$wall" "${cov:--}" "${ft:--}" "${corp:--}" \
        "$(ls "$corpus" | wc -l)" "$(stat_of "$log" peak_rss_mb)" "$n"
    if [ "$n" -gt 0 ]; then
        grep -m3 -E '^(==[0-9]+==ERROR|SUMMARY|.*runtime error)' "$log" | sed 's/^/    /' || true
        for a in $artifacts; do echo "    input: $a"; done
        [ -z "$artifacts" ] && echo "    fuzz_$t exited $rc without an input (log: $log)"
        found_in+=("fuzz_$t")
    fi
    total_execs=$((total_execs + ${execs:-0}))
    total_found=$((total_found + n))
done
if [ "$total_found" -gt 0 ]; then
    echo "fuzz.sh: $total_found finding(s) in ${found_in[*]}; $total_execs executions over ${#FUZZ_TARGETS[@]} targets; logs in $DIR"
    exit 1
fi
echo "fuzz.sh: no findings; $total_execs executions over ${#FUZZ_TARGETS[@]} targets; corpora in $DIR"
