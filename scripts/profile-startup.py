#!/usr/bin/env python3
"""Where a `bench startup` round's host CPU goes (issue 27 §1), from a
`perf record -e cpu-clock -c PERIOD -k mono` of the whole bench (no PMU on this
host, so cpu-clock: one sample per PERIOD ns of CPU).

Every sample is given to the process that took it, classified by how it came
to be: the bench process itself is the runtime (and forks of it that never
exec are its keepers), an exec of burstvm-vmm a VMM, of burstvm-cni (or a
delegated IPAM plugin) CNI, of burstvm with `nic` the NIC daemon; kernel
threads are `kernel` (work the host does for nobody's account, e.g. freeing
a dead VMM's memory). A round's window is its trace: from its first stage's
start to its last stage's end, both on CLOCK_MONOTONIC like the samples.

Usage: scripts/profile-startup.sh (it runs perf and this).
       profile-startup.py PERF_DATA TRACE_JSONL PERIOD_NS ROOT_PID [--top N]
"""

import collections
import json
import re
import subprocess
import sys

FORK = re.compile(r"PERF_RECORD_FORK\((\d+):(\d+)\):\((\d+):(\d+)\)")
EXEC = re.compile(r"PERF_RECORD_COMM exec: (.*):(\d+)/(\d+)")
SAMPLE = re.compile(r"^\s*(\S.*?)\s+(\d+)/(\d+)\s+(\d+\.\d+):\s+(.*)$")


def rounds_of(trace_path):
    """(label, n sandboxes, start s, end s) per round, in order."""
    groups = {}
    with open(trace_path) as f:
        for line in f:
            ev = json.loads(line)
            group = ev["sandbox"].rsplit("-", 1)[0]
            g = groups.setdefault(group, [set(), ev["start_ns"], ev["end_ns"]])
            g[0].add(ev["sandbox"])
            g[1] = min(g[1], ev["start_ns"])
            g[2] = max(g[2], ev["end_ns"])
    out = [(k, len(v[0]), v[1] / 1e9, v[2] / 1e9) for k, v in groups.items()]
    return sorted(out, key=lambda r: r[2])


def main():
    args = sys.argv[1:]
    top = 12
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i : i + 2]
    perf_data, trace_path, period_ns, root = args[0], args[1], int(args[2]), int(args[3])
    rounds = rounds_of(trace_path)

    role = {root: "runtime"}  # pid -> role, for the bench's process tree
    samples = collections.defaultdict(list)  # round -> [(role, sym, dso)]
    p = subprocess.Popen(
        ["perf", "script", "-i", perf_data, "--show-task-events",
         "-F", "comm,pid,tid,time,ip,sym,dso"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, errors="replace")
    for line in p.stdout:
        m = FORK.search(line)
        if m:
            child, par = int(m.group(1)), int(m.group(3))
            if child != par and par in role:  # a new process of the tree
                role[child] = role[par]
            continue
        m = EXEC.search(line)
        if m:
            comm, pid = m.group(1), int(m.group(2))
            if pid not in role or pid == root:
                continue
            if comm == "burstvm-vmm":
                role[pid] = "vmm"
            elif comm in ("burstvm-cni", "host-local", "static", "loopback", "bridge"):
                role[pid] = "cni"
            elif comm == "burstvm":
                role[pid] = "nic daemon"  # the only burstvm the bench execs
            else:
                role[pid] = "other:" + comm
            continue
        if "PERF_RECORD" in line:
            continue
        m = SAMPLE.match(line)
        if not m:
            continue
        comm, pid, t, rest = m.group(1), int(m.group(2)), float(m.group(4)), m.group(5)
        if pid == 0:
            continue  # idle
        who = role.get(pid)
        if who is None:
            kthread = ("kworker", "ksoftirqd", "kswapd", "rcu", "migration", "khugepaged", "kcompactd")
            who = "kernel" if comm.startswith(kthread) else "outside:" + comm
        # "sym+off (dso)" or "sym (dso)"
        sm = re.match(r"(?:[0-9a-f]+\s+)?(.*?)\s+\((.*)\)\s*$", rest.strip())
        sym, dso = (sm.group(1), sm.group(2)) if sm else (rest.strip(), "?")
        sym = re.sub(r"\+0x[0-9a-f]+$", "", sym)
        for label, n, t0, t1 in rounds:
            if t0 <= t <= t1:
                samples[label].append((who, sym, dso.rsplit("/", 1)[-1]))
                break
    p.wait()

    per = period_ns / 1e6
    for label, n, t0, t1 in rounds:
        s = samples.get(label, [])
        print(f"== round {label}: {n} sandboxes, window {1000 * (t1 - t0):.0f} ms, "
              f"{len(s) * per:.0f} ms host CPU ({len(s) * per / n:.2f} ms per start)")
        by_role = collections.Counter(w for w, _, _ in s)
        for who, c in by_role.most_common():
            print(f"  {who:<14} {c * per / n:8.2f} ms/start  {100 * c / max(1, len(s)):5.1f}%")
            syms = collections.Counter((sym, dso) for w, sym, dso in s if w == who)
            for (sym, dso), k in syms.most_common(top):
                print(f"      {k * per / n:7.2f}  {sym[:70]:<70} {dso}")
        print()


if __name__ == "__main__":
    main()
