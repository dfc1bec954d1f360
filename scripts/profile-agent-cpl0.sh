#!/usr/bin/env bash
# The built-in agent's guest-side cost per start on a host that emulates CPL0 guest code
# (kvm_pvm): emulated instructions by agent function, exits, MMIO and port accesses, for
# one sandbox of each variant (docs/guest.md "The agent at CPL3").
#   scripts/profile-agent-cpl0.sh [OUT_DIR] [-- VARIANT...]   (default: no-net fastiov window)
# Extra `bench startup` arguments go in BENCH_ARGS (e.g. BENCH_ARGS="--net-pool 1").
set -euo pipefail
cd "$(dirname "$0")/.."
out=profile-agent-cpl0
if [[ $# -gt 0 && $1 != -- ]]; then out=$1; shift; fi
[[ ${1:-} == -- ]] && shift
variants=("$@")
[[ ${#variants[@]} -gt 0 ]] || variants=(no-net fastiov window)
command -v perf >/dev/null || { echo "perf is missing: apt-get install linux-perf" >&2; exit 1; }
bin=target/x86_64-unknown-linux-gnu/release/burstvm
[[ -x $bin ]] || cargo build --release
# The image the VMM boots is guest/'s build output; its ELF has the symbols.
elf=$(ls -t target/x86_64-unknown-linux-gnu/release/build/guest-*/out/agent.elf 2>/dev/null | head -1)
[[ -n $elf ]] || { echo "no agent.elf under target/: cargo build --release first" >&2; exit 1; }
mkdir -p "$out"
args=()
for v in "${variants[@]}"; do
    # shellcheck disable=SC2086 # BENCH_ARGS is a list of words
    perf record -q -a -o "$out/$v.data" \
        -e kvm:kvm_emulate_insn,kvm:kvm_userspace_exit,kvm:kvm_mmio,kvm:kvm_pio -- \
        "$bin" bench startup --out "$out/$v" --concurrency 1 --variants "$v" --no-warmup \
        ${BENCH_ARGS:-} > "$out/$v.txt"
    args+=("$v=$out/$v.data")
done
nm -n "$elf" > "$out/agent.map"
python3 scripts/profile-agent-cpl0.py "$out/agent.map" "${args[@]}" | tee "$out/profile.txt"
