#!/usr/bin/env python3
"""Where a built-in agent start's guest-side cost goes on a host whose KVM emulates
guest code at CPL0 (kvm_pvm, docs/guest.md "The agent at CPL3"): the emulated
instructions by agent function, and the exits, from a `perf record -a -e
kvm:kvm_emulate_insn,kvm:kvm_userspace_exit,kvm:kvm_mmio,kvm:kvm_pio` of one
`bench startup --concurrency 1 --no-warmup` per variant (scripts/profile-agent-cpl0.sh).

Usage: profile-agent-cpl0.py AGENT_MAP VARIANT=PERF_DATA...   (AGENT_MAP: `nm -n agent.elf`)
"""

import bisect
import collections
import importlib.util
import os
import re
import subprocess
import sys

# The symbol table reader of the guest-kernel profile (System.map and `nm -n` print alike).
_spec = importlib.util.spec_from_file_location(
    "profile_guest_boot", os.path.join(os.path.dirname(__file__), "profile-guest-boot.py")
)
_boot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_boot)

EMULATE = re.compile(r"kvm:kvm_emulate_insn: \w+:([0-9a-f]+):")
MMIO = re.compile(r"kvm:kvm_mmio: mmio (\S+) len \d+ gpa (0x[0-9a-f]+)")


def region(gpa):
    if 0xFEE00000 <= gpa < 0xFEE01000:
        return "LAPIC (in KVM)"
    if 0xFEC00000 <= gpa < 0xFEC01000:
        return "IOAPIC (in KVM)"
    return "virtio-mmio"


def count(perf_data, syms):
    addrs, names = syms
    by_fn, mmio = collections.Counter(), collections.Counter()
    exits = pio = 0
    script = subprocess.run(
        ["perf", "script", "-i", perf_data], capture_output=True, text=True, check=True
    ).stdout
    for line in script.splitlines():
        m = EMULATE.search(line)
        if m:
            rip = int(m.group(1), 16)
            i = bisect.bisect_right(addrs, rip) - 1
            by_fn[names[i] if i >= 0 else "?"] += 1
        elif "kvm:kvm_userspace_exit" in line:
            exits += 1
        elif "kvm:kvm_pio" in line:
            pio += 1
        else:
            m = MMIO.search(line)
            if m and m.group(1) in ("write", "read"):
                mmio[region(int(m.group(2), 16))] += 1
    return by_fn, mmio, exits, pio


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    syms = _boot.symbols(sys.argv[1])
    runs = [a.split("=", 1) for a in sys.argv[2:]]
    counted = {v: count(d, syms) for v, d in runs}
    names = [v for v, _ in runs]
    print("per start, %s" % ", ".join(names))
    print("%-30s" % "" + "".join("%10s" % v for v in names))
    rows = [
        ("emulated instructions", lambda c: sum(c[0].values())),
        ("exits to the VMM", lambda c: c[2]),
        ("port accesses", lambda c: c[3]),
    ]
    kinds = sorted({k for c in counted.values() for k in c[1]})
    # kvm_pvm traces MMIO writes only (reads complete without a kvm_mmio event).
    rows += [("MMIO writes: " + k, lambda c, k=k: c[1][k]) for k in kinds]
    for label, f in rows:
        print("%-30s" % label + "".join("%10d" % f(counted[v]) for v in names))
    fns = collections.Counter()
    for c in counted.values():
        fns.update(c[0])
    print("emulated instructions by agent function")
    for fn, _ in fns.most_common():
        print("  %-24s" % fn + "".join("%10d" % counted[v][0][fn] for v in names))


if __name__ == "__main__":
    main()
