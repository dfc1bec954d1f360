#!/usr/bin/env bash
# burstvm's NIC dataplane against DPDK's vhost backend, side by side in one run
# (issue 12): builds the release binary and runs
#   burstvm bench dataplane --peer dpdk [ARGS...]
# e.g. scripts/bench-dpdk.sh --sizes 64,1500 --duration 2 --reps 3
# Needs root (it reserves 2 MiB hugepages and gives them back) and dpdk-testpmd
# (scripts/setup.sh installs dpdk-dev). Topology and counting: docs/nic.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p burstvm
exec "${CARGO_TARGET_DIR:-target}/release/burstvm" bench dataplane --peer dpdk "$@"
