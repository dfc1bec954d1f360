#!/usr/bin/env bash
# Builds burstvm's condensed guest kernel (RunD §4.3) from Debian's linux-source:
# `make tinyconfig`, merge guest/linux/burstvm.fragment, olddefconfig, apply
# guest/linux/patches/*.patch, `make vmlinux`. The result is cached by content
# hash (fragment + patches + this script + linux-source version) in
# $BURSTVM_KERNEL_CACHE (default /var/cache/burstvm/kernel)/<hash>/vmlinux, so a
# second run is instant. One source tree is kept beside the cache so that a
# changed fragment or patch rebuilds only what it touches.
#
# Usage: scripts/build-guest-kernel.sh            build if needed; print the vmlinux path
#        scripts/build-guest-kernel.sh --cached   print the path if built, else fail (tests)
# Run it under the CPU lock: `flock /tmp/burstvm-cpu.lock scripts/build-guest-kernel.sh`
# (~12 min on 2 cores the first time).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
self=$repo/scripts/build-guest-kernel.sh
cache=${BURSTVM_KERNEL_CACHE:-/var/cache/burstvm/kernel}
pkg=linux-source-6.1
frag=$repo/guest/linux/burstvm.fragment
shopt -s nullglob
patches=("$repo"/guest/linux/patches/*.patch)
shopt -u nullglob

ver=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null) ||
  { echo "build-guest-kernel: $pkg is not installed (scripts/setup.sh installs it)" >&2; exit 1; }
hash=$({
  echo "$pkg $ver"
  printf '%s\n' "${patches[@]##*/}"
  cat "$frag" "$self" "${patches[@]}"
} | sha256sum | cut -c1-16)
out=$cache/$hash
if [ -f "$out/vmlinux" ]; then
  echo "$out/vmlinux"
  exit 0
fi
if [ "${1:-}" = "--cached" ]; then
  echo "build-guest-kernel: no kernel for hash $hash in $cache; run scripts/build-guest-kernel.sh (scripts/setup.sh does)" >&2
  exit 1
fi

for tool in bc flex bison make gcc; do
  command -v "$tool" >/dev/null || { echo "build-guest-kernel: $tool is missing (scripts/setup.sh installs it)" >&2; exit 1; }
done
[ -f /usr/include/libelf.h ] || { echo "build-guest-kernel: libelf-dev is missing" >&2; exit 1; }

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9 # one build per cache at a time; a waiting run then finds the result
if [ -f "$out/vmlinux" ]; then
  echo "$out/vmlinux"
  exit 0
fi

tree=$cache/tree
log=$cache/build-$hash.log
# Any failure leaves the tree in an unknown state: the next run extracts afresh.
trap 'rm -f "$tree/.burstvm-source"; echo "build-guest-kernel: failed; see $log" >&2' ERR

if [ "$(cat "$tree/.burstvm-source" 2>/dev/null)" != "$pkg $ver" ]; then
  echo "build-guest-kernel: extracting $pkg $ver" >&2
  rm -rf "$tree"
  mkdir -p "$tree"
  tar -xJf "/usr/src/$pkg.tar.xz" -C "$tree" --strip-components=1
  mkdir -p "$tree/.burstvm-applied"
  echo "$pkg $ver" >"$tree/.burstvm-source"
fi

# Revert the previous build's patches (kept in .burstvm-applied), apply ours.
applied=("$tree"/.burstvm-applied/*.patch)
for ((i = ${#applied[@]} - 1; i >= 0; i--)); do
  [ -f "${applied[i]}" ] || continue
  patch -s -p1 -R -d "$tree" --no-backup-if-mismatch <"${applied[i]}"
  rm "${applied[i]}"
done
for p in "${patches[@]}"; do
  patch -s -p1 -N -d "$tree" --no-backup-if-mismatch <"$p"
  cp "$p" "$tree/.burstvm-applied/"
done

export KBUILD_BUILD_USER=burstvm KBUILD_BUILD_HOST=burstvm
echo "build-guest-kernel: configuring (tinyconfig + $(basename "$frag"))" >&2
{
  make -C "$tree" tinyconfig
  "$tree/scripts/kconfig/merge_config.sh" -m -O "$tree" "$tree/.config" "$frag"
  make -C "$tree" olddefconfig
} >"$log" 2>&1

# Every line of the fragment must hold: a dependency the fragment misses
# would otherwise silently drop an option.
bad=0
while IFS= read -r line; do
  case "$line" in
    CONFIG_*=*)
      grep -qxF "$line" "$tree/.config" || { echo "build-guest-kernel: not in .config: $line" >&2; bad=1; } ;;
    "# CONFIG_"*" is not set")
      sym=${line#\# }
      sym=${sym%% *}
      if grep -q "^$sym=" "$tree/.config"; then echo "build-guest-kernel: still set: $sym" >&2; bad=1; fi ;;
  esac
done <"$frag"
[ "$bad" = 0 ] || { rm -f "$tree/.burstvm-source"; exit 1; }

echo "build-guest-kernel: make -j$(nproc) vmlinux (log: $log)" >&2
make -C "$tree" -j"$(nproc)" vmlinux >>"$log" 2>&1

rm -rf "$out.tmp"
mkdir -p "$out.tmp"
cp "$tree/vmlinux" "$tree/.config" "$tree/System.map" "$out.tmp/"
mv "$out.tmp" "$out"
echo "$out/vmlinux"
