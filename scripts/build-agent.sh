#!/usr/bin/env bash
# Builds burstvm's guest agent for Linux guests (agent/, binary burstvm-agent)
# as a static binary and prints its path; with --initramfs OUT also writes the
# guest's initramfs (newc cpio: /init = the agent; agent_proto::write_initramfs).
# docs/guest.md, "The guest agent (Linux guests)".
#
# Usage: scripts/build-agent.sh [--initramfs OUT]
set -euo pipefail
cd "$(dirname "$0")/.."

initramfs=
while [ $# -gt 0 ]; do
  case "$1" in
    --initramfs) initramfs="${2:?--initramfs needs a path}"; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "build-agent.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

target=x86_64-unknown-linux-gnu
# Static like every burstvm executable (.cargo/config.toml); the `agent`
# profile makes it small (Cargo.toml), since it is read into guest memory at
# every boot.
cargo build --profile agent -p agent --bin burstvm-agent --target "$target" >&2
bin="${CARGO_TARGET_DIR:-$PWD/target}/$target/agent/burstvm-agent"

# Static: no dynamic section asking for libraries or an interpreter.
if readelf -lW "$bin" | grep -q 'INTERP' || readelf -dW "$bin" | grep -q '(NEEDED)'; then
  echo "build-agent.sh: $bin is not static:" >&2
  readelf -dW "$bin" | grep '(NEEDED)' >&2 || true
  exit 1
fi
if command -v file >/dev/null; then
  file "$bin" | grep -Eq 'static(-pie)? linked' || { file "$bin" >&2; echo "build-agent.sh: file(1) does not call $bin static" >&2; exit 1; }
fi

if [ -n "$initramfs" ]; then
  # Same target and flags as the agent's release build.
  cargo run -q --release --target "$target" -p agent-proto --example write-initramfs -- "$bin" "$initramfs" >&2
fi
echo "$bin"
