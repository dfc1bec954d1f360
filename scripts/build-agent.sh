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
# With --target, RUSTFLAGS reaches only the target's crates (not build
# scripts or proc-macros, which run on the host).
export RUSTFLAGS="-C target-feature=+crt-static"
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols
# Small (it is read into guest memory at every boot): stripped,
# size-optimised, one codegen unit, LTO (2.1 MB; 2.8 MB without). Panics
# still unwind: a panicking connection thread must not take PID 1 (and the
# kernel) down.
export CARGO_PROFILE_RELEASE_OPT_LEVEL=s CARGO_PROFILE_RELEASE_LTO=fat CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1
cargo build --release -p agent --bin burstvm-agent --target "$target" >&2
bin="${CARGO_TARGET_DIR:-$PWD/target}/$target/release/burstvm-agent"

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
  # Same target and flags as the agent: its dependencies are built already.
  cargo run -q --release --target "$target" -p agent-proto --example write-initramfs -- "$bin" "$initramfs" >&2
fi
echo "$bin"
