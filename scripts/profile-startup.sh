#!/usr/bin/env bash
# Where the host CPU of a `bench startup` round goes, by process and symbol
# (issue 27 §1): perf's cpu-clock (this host has no PMU) over the whole
# machine, samples on CLOCK_MONOTONIC so that the bench's trace cuts them
# into rounds. Arguments after the script's own are `bench startup`'s.
#   scripts/profile-startup.sh [OUT_DIR] -- --concurrency 50 --variants no-net,fastiov
set -euo pipefail
cd "$(dirname "$0")/.."
out=profile-startup
if [[ $# -gt 0 && $1 != -- ]]; then out=$1; shift; fi
[[ ${1:-} == -- ]] && shift
period=${PERIOD_NS:-250000} # one sample per 250 µs of CPU
command -v perf >/dev/null || { echo "perf is missing: apt-get install linux-perf" >&2; exit 1; }
mkdir -p "$out"
bin=target/x86_64-unknown-linux-gnu/release/burstvm
[[ -x $bin ]] || cargo build --release
# The bench's pid is its process tree's root; record it before the exec.
perf record -q -e cpu-clock -c "$period" -a -k mono -o "$out/perf.data" -- \
    sh -c 'echo $$ > "$0/root.pid"; exec "$@"' "$out" "$bin" bench startup --out "$out/bench" "$@" \
    | tee "$out/bench.txt"
python3 scripts/profile-startup.py "$out/perf.data" "$out/bench/trace.jsonl" "$period" \
    "$(cat "$out/root.pid")" | tee "$out/profile.txt"
