#!/usr/bin/env bash
# Where an emulated guest kernel spends a container start (docs/guest.md, "Boot
# cost under kvm_pvm"): on kvm_pvm every instruction the guest kernel runs goes
# through KVM's emulator, and the kvm:kvm_emulate_insn tracepoint names its RIP.
# This records every one over `burstvm run --kernel ...` (a few GB of perf data
# for ~20 M instructions; the report is made and the data removed) and prints
# the instruction count per kernel function (the kernel's System.map, beside the
# vmlinux that scripts/build-guest-kernel.sh caches) and the hottest functions of
# each second. Arguments after the script's own are `burstvm run`'s; without
# them it runs the README's busybox container.
#   scripts/profile-guest-boot.sh [OUT_DIR] [-- RUN_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=profile-guest-boot
if [[ $# -gt 0 && $1 != -- ]]; then out=$1; shift; fi
[[ ${1:-} == -- ]] && shift
command -v perf >/dev/null || { echo "perf is missing: apt-get install linux-perf" >&2; exit 1; }
kernel=$(scripts/build-guest-kernel.sh --cached)
map=$(dirname "$kernel")/System.map
bin=target/x86_64-unknown-linux-gnu/release/burstvm
[[ -x $bin ]] || cargo build --release
if [[ $# -eq 0 ]]; then
  images=${IMAGES:-/tmp/images}
  [[ -f $images/busybox.tar ]] || scripts/build-images.sh "$images" >/dev/null
  set -- --variant no-net --kernel "$kernel" "$images/busybox.tar" -- sh -c 'echo hello; exit 3'
fi
mkdir -p "$out"
perf record -q -a -e kvm:kvm_emulate_insn -o "$out/perf.data" -- "$bin" run "$@" >"$out/run.txt" 2>&1 || true
perf script -i "$out/perf.data" -F time,trace 2>/dev/null |
  python3 scripts/profile-guest-boot.py "$map" | tee "$out/profile.txt"
rm -f "$out/perf.data"
