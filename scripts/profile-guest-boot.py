#!/usr/bin/env python3
"""Emulated instructions per guest-kernel function, from `perf script -F
time,trace` lines of kvm:kvm_emulate_insn ("TIME: CSBASE:RIP:BYTES (MODE)")
on stdin, named with the guest kernel's System.map. Prints the total, the
top functions, and the top four of every second of the run.

Usage: scripts/profile-guest-boot.sh (it runs perf and this).
       profile-guest-boot.py SYSTEM_MAP [--top N]
"""

import bisect
import collections
import sys


def symbols(path):
    """Sorted start addresses and names of the text symbols."""
    syms = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1] in "tTwW":
                syms.append((int(parts[0], 16), parts[2]))
    syms.sort()
    return [a for a, _ in syms], [n for _, n in syms]


def main():
    args = sys.argv[1:]
    top = 40
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i : i + 2]
    addrs, names = symbols(args[0])
    total = collections.Counter()
    per_second = collections.defaultdict(collections.Counter)
    first = None
    for line in sys.stdin:
        try:
            when, rest = line.split(":", 1)
            rip = int(rest.split(":")[1], 16)
            t = float(when)
        except (ValueError, IndexError):
            continue
        if first is None:
            first = t
        if rip < 0xFFFF_8000_0000_0000:
            name = "(user)"
        else:
            i = bisect.bisect_right(addrs, rip) - 1
            name = names[i] if i >= 0 else "(unknown)"
        total[name] += 1
        per_second[int(t - first)][name] += 1
    n = sum(total.values())
    print(f"emulated instructions: {n}")
    for name, c in total.most_common(top):
        print(f"{c:9d} {100 * c / max(n, 1):5.1f}%  {name}")
    print("per second of the run (instructions, hottest four):")
    for s in sorted(per_second):
        row = per_second[s]
        hot = " ".join(f"{k}:{v}" for k, v in row.most_common(4))
        print(f"{s:4d} {sum(row.values()):8d}  {hot}")


if __name__ == "__main__":
    main()
