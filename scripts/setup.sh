#!/usr/bin/env bash
# Installs what burstvm needs on a fresh Debian 12 machine (run as root).
# Idempotent: a second run only checks.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

pkgs=(gcc binutils libclang-dev iproute2 fonts-dejavu-core linux-image-amd64 zstd xz-utils
  # rootfs: EROFS images, the XFS of writable layers, the ext4 template
  erofs-utils xfsprogs e2fsprogs mount
  # the test images of scripts/build-images.sh (busybox.tar; cpio for initramfs checks)
  busybox-static cpio
  # the condensed guest kernel (scripts/build-guest-kernel.sh)
  linux-source-6.1 bc flex bison libelf-dev make
  # containerd (1.6, runs without systemd) for the shim; protobuf-compiler for the CRI bindings
  containerd protobuf-compiler
  # dpdk-testpmd (virtio-user and vhost PMDs): the NIC's interop test and
  # `burstvm bench dataplane --peer dpdk` (docs/nic.md)
  dpdk-dev
  # perf (cpu-clock) for scripts/profile-startup.sh
  linux-perf)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

command -v cargo >/dev/null || { echo "setup: cargo (Rust >= 1.85) is required; install it with rustup" >&2; exit 1; }
command -v go >/dev/null || [ -x /usr/local/go/bin/go ] || { apt-get install -y -qq golang-go >/dev/null; }
export PATH="$PATH:/usr/local/go/bin"

# The reference CNI tools: cnitool, the host-local IPAM plugin, loopback
# (containerd's CRI plugin sets up lo with it) and bridge (the `tap`
# variant's software CNI, as Kata users run it), in /opt/cni/bin.
mkdir -p /opt/cni/bin
if [ ! -x /opt/cni/bin/cnitool ] || [ ! -x /opt/cni/bin/host-local ]; then
  GOBIN=/opt/cni/bin go install github.com/containernetworking/cni/cnitool@v1.3.1
  GOBIN=/opt/cni/bin go install github.com/containernetworking/plugins/plugins/ipam/host-local@v1.9.1
fi
if [ ! -x /opt/cni/bin/loopback ]; then
  GOBIN=/opt/cni/bin go install github.com/containernetworking/plugins/plugins/main/loopback@v1.9.1
fi
if [ ! -x /opt/cni/bin/bridge ]; then
  GOBIN=/opt/cni/bin go install github.com/containernetworking/plugins/plugins/main/bridge@v1.9.1
fi
# Debian's containerd package would start a host-wide daemon under systemd;
# burstvm's tests and bench start their own, with their own config and sockets.
command -v containerd >/dev/null && command -v ctr >/dev/null || { echo "setup: containerd/ctr missing" >&2; exit 1; }

[ -c /dev/kvm ] || echo "setup: warning: /dev/kvm is missing; sandboxes cannot start" >&2
mkdir -p /run/burstvm
# The runtime's state lives for one boot (sockets, logs, IPAM leases, the NIC's
# state file), so it belongs on tmpfs, as /run is on systemd hosts. Where /run
# is on the root disk, every file a sandbox start makes costs the disk
# filesystem's inode work: 0.5-1.5 ms of host CPU per networked start here
# (docs/runtime.md "The state directory"). Mounted only while nothing is in it.
if [ "$(stat -f -c %T /run/burstvm)" != tmpfs ]; then
  if [ -z "$(ls -A /run/burstvm)" ]; then
    mount -t tmpfs -o mode=0755,nosuid,nodev burstvm-state /run/burstvm
  else
    echo "setup: warning: /run/burstvm is not on tmpfs and is in use; not mounting one over it" >&2
  fi
fi

# Moving a VMM into its cgroups waits for an RCU grace period per move (~8 ms
# here) unless a cgroup2 mount has favordynmods (Linux >= 6.0), which makes
# task migrations cheap at a small cost to fork and exit (docs/runtime.md
# "Joining the cgroups"). One mount with it is enough: the lock is global.
if ! awk '$3 == "cgroup2" && $4 ~ /(^|,)favordynmods(,|$)/ {found=1} END {exit !found}' /proc/mounts; then
  cg2=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/mounts)
  if [ -n "$cg2" ]; then
    mount -o remount,favordynmods "$cg2" ||
      echo "setup: warning: cannot remount $cg2 with favordynmods; each VMM start waits ~10 ms more" >&2
  fi
fi

# The condensed guest kernel, built once per machine and cached by content
# hash (~12 min on 2 cores the first time, instant after).
"$(dirname "$0")/build-guest-kernel.sh" >/dev/null
echo "setup: ok"
