#!/usr/bin/env bash
# What each kind of guest event costs the host here (docs/guest.md, "The agent at CPL3"):
# a 64-bit guest runs 2,000 of each (emulated CPL0 instructions, port and MMIO exits from
# CPL0 and from CPL3, CPL3 -> CPL0 -> CPL3 round trips, first and second page touches from
# CPL3) and the runner prints the vCPU thread's CPU per event. Run as root.
set -euo pipefail
d=$(mktemp -d); trap 'rm -rf "$d"' EXIT
cd "$(dirname "$0")"
gcc -c guest.S -o "$d/g.o"
objcopy -O binary -j .text "$d/g.o" "$d/guest.bin"
( cd "$d" && objcopy -I binary -O elf64-x86-64 -B i386:x86-64 guest.bin guestbin.o )
off() { printf '0x%s' "$(nm "$d/g.o" | awk -v s="$1" '$3 == s {print $1}')"; }
gcc -O2 -Doff_ud="$(off off_ud)" -Doff_other="$(off off_other)" vm.c "$d/guestbin.o" -o "$d/vm" 2>/dev/null
"$d/vm"
