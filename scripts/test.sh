#!/usr/bin/env bash
# The test suite: unit tests of every crate and the integration tests in cli/tests
# (they boot microVMs, start NIC daemons, create netns/veth/tap; run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/cni/bin:$PATH"
# The static guest agent the container tests boot (cli/tests/container_run.rs).
scripts/build-agent.sh >/dev/null
exec cargo test --workspace --no-fail-fast "$@"
