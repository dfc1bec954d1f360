#!/usr/bin/env bash
# The test suite: unit tests of every crate and the integration tests in cli/tests
# (they boot microVMs, start NIC daemons, create netns/veth/tap; run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/cni/bin:$PATH"
exec cargo test --workspace --no-fail-fast "$@"
