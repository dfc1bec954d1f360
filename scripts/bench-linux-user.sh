#!/usr/bin/env bash
# What Linux user space costs in a burstvm guest (docs/guest.md, "User space
# under kvm_pvm"; results in docs/results.md): boots the condensed kernel
# under `burstvm vmm` on an EROFS root holding guest/linux/selftest.c (static),
# runs `selftest bench` as burstvm init's command (one getpid, one
# fork+execve+wait of a static binary, a user-space compute loop), and runs
# the same compute loop on the host in the same run, for the ratio.
# Boot to the first user instruction is the VMM's `boot` stage (vCPU start to
# init's BOOT event on the agent port, the first thing init does after one
# ioperm system call).
#
# Usage: scripts/bench-linux-user.sh [--reps N]      (as root; builds nothing
#        but the image: run `cargo build --release` and setup.sh first)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
reps=1
[ "${1:-}" = "--reps" ] && reps=${2:?--reps N}
bin=${BURSTVM_BIN:-$repo/target/x86_64-unknown-linux-gnu/release/burstvm}
[ -x "$bin" ] || { echo "bench-linux-user: $bin missing (cargo build --release)" >&2; exit 1; }
kernel=$("$repo/scripts/build-guest-kernel.sh" --cached)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/root/bin"
cc -O2 -static -pthread "$repo/guest/linux/selftest.c" -o "$work/root/bin/selftest"
image=$("$bin" rootfs build --init --cache "$work/cache" "$work/root" | sed -n 's/^image   //p')

for ((r = 1; r <= reps; r++)); do
  host=$("$work/root/bin/selftest" compute | sed -n 's/^compute_ms=//p')
  "$bin" vmm --sandbox "bench-user-$$-$r" --memory 128M --timeout 0 --until-exit \
    --kernel "$kernel" --trace "$work/trace.json" \
    --cmdline "console=ttyS0 reboot=k panic=-1 root=/dev/vda rootfstype=erofs ro -- /bin/selftest bench" \
    --disk "path=$image,ro" >"$work/console" 2>"$work/stderr" || {
    echo "bench-linux-user: the VM failed:" >&2
    tail -20 "$work/console" "$work/stderr" >&2
    exit 1
  }
  line=$(grep -a '^bench: ' "$work/console" | tr -d '\r')
  guest=$(sed -n 's/.*compute_ms=\([0-9]*\).*/\1/p' <<<"$line")
  boot_ms=$(python3 -c '
import json, sys
for l in open(sys.argv[1]):
    e = json.loads(l)
    if e["stage"] == "boot" and e["sandbox"] == sys.argv[2]:
        print("%.0f" % ((e["end_ns"] - e["start_ns"]) / 1e6))
' "$work/trace.json" "bench-user-$$-$r")
  echo "rep $r: boot to first user instruction ${boot_ms} ms; ${line#bench: }; host compute_ms=$host; guest/host compute $(python3 -c "print(round($guest / $host, 2))")"
done
