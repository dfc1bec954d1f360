#!/usr/bin/env bash
# Builds the OCI image tarballs (OCI archives: a tar of an image layout) that
# burstvm's tests import with `ctr image import` or build with `burstvm rootfs
# build` (nothing is pulled from a registry):
#   OUT/app.tar      burstvm.local/app:1      /app (exits 0), /app-exit3 (exits 3); entrypoint /app
#   OUT/pause.tar    burstvm.local/pause:1    /pause (exits 0): the CRI sandbox image
#   OUT/busybox.tar  burstvm.local/busybox:1  Debian's busybox-static as /bin/busybox, every
#                    applet a symlink in /bin; users root and app (1000:1000, also in wheel
#                    (10)); Cmd ["sh"]
#   with --debian:
#   OUT/debian-python.tar  burstvm.local/debian-python:1  Debian bookworm minbase with
#                    python3-minimal (mmdebstrap, packages from the apt mirror; a 48 MB
#                    archive); Cmd ["python3"]
# The app and pause files are app payloads for the built-in agent: the header
# "BVMAPP01" and a little-endian u32 exit status (docs/guest.md), then
# deterministic filler.
# Deterministic: the same script gives byte-identical tarballs (debian-python:
# as long as the mirror serves the same packages).
set -euo pipefail
usage="usage: build-images.sh [--debian] OUTDIR"
debian=0
out=
for a in "$@"; do
  case $a in
    --debian) debian=1 ;;
    -*) echo "$usage" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "$usage" >&2; exit 2; }; out=$a ;;
  esac
done
[ -n "$out" ] || { echo "$usage" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

payload() { # status bytes-of-filler
  printf 'BVMAPP01'
  printf "\\x$(printf %02x "$1")\\x00\\x00\\x00"
  head -c "$2" /dev/zero | tr '\0' 'b'
}

sha() { sha256sum "$1" | cut -d' ' -f1; }

# pack NAME TARNAME CONFIG: $work/TARNAME/layer.tar (made by the caller) as
# the single layer of an OCI archive OUT/TARNAME.tar, CONFIG the image
# config's "config" object (JSON).
pack() {
  local name=$1 tarname=$2 config=$3
  local d="$work/$tarname"
  rm -rf "$d/oci" && mkdir -p "$d/oci/blobs/sha256"
  gzip -9 -n -c "$d/layer.tar" >"$d/layer.tar.gz"
  local diff layer lsize
  diff=$(sha "$d/layer.tar")
  layer=$(sha "$d/layer.tar.gz")
  lsize=$(stat -c %s "$d/layer.tar.gz")
  cp "$d/layer.tar.gz" "$d/oci/blobs/sha256/$layer"
  printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$config" "$diff" >"$d/config.json"
  local cfg csize
  cfg=$(sha "$d/config.json")
  csize=$(stat -c %s "$d/config.json")
  cp "$d/config.json" "$d/oci/blobs/sha256/$cfg"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}]}' \
    "$cfg" "$csize" "$layer" "$lsize" >"$d/manifest.json"
  local man msize
  man=$(sha "$d/manifest.json")
  msize=$(stat -c %s "$d/manifest.json")
  cp "$d/manifest.json" "$d/oci/blobs/sha256/$man"
  printf '{"imageLayoutVersion":"1.0.0"}' >"$d/oci/oci-layout"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$man" "$msize" "$name" "${name##*:}" >"$d/oci/index.json"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf "$out/$tarname.tar" -C "$d/oci" .
}

# app_image NAME ENTRYPOINT TARNAME FILE=STATUS...
app_image() {
  local name=$1 entry=$2 tarname=$3
  shift 3
  local d="$work/$tarname"
  rm -rf "$d" && mkdir -p "$d/rootfs"
  for f in "$@"; do
    payload "${f#*=}" 1012 >"$d/rootfs/${f%=*}"
    chmod 0755 "$d/rootfs/${f%=*}"
  done
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf "$d/layer.tar" -C "$d/rootfs" .
  pack "$name" "$tarname" "$(printf '{"Entrypoint":["%s"],"WorkingDir":"/"}' "$entry")"
}

# busybox-static with its applets, two users, /tmp and a home.
busybox_image() {
  local bb=/bin/busybox
  [ -x "$bb" ] || { echo "build-images.sh: $bb missing (apt-get install busybox-static)" >&2; exit 1; }
  local d="$work/busybox" r="$work/busybox/rootfs"
  rm -rf "$d" && mkdir -p "$r"
  (umask 022 && mkdir -p "$r/bin" "$r/dev" "$r/etc" "$r/home/app" "$r/proc" "$r/root" "$r/sys" "$r/tmp")
  chmod 0755 "$r" "$r/bin" "$r/dev" "$r/etc" "$r/home" "$r/home/app" "$r/proc" "$r/sys"
  chmod 0700 "$r/root"
  chmod 1777 "$r/tmp"
  install -m 0755 "$bb" "$r/bin/busybox"
  local a
  for a in $("$bb" --list); do
    [ "$a" = busybox ] || ln -s busybox "$r/bin/$a"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n' >"$r/etc/passwd"
  printf 'root:x:0:\nwheel:x:10:app\napp:x:1000:\n' >"$r/etc/group"
  printf 'NAME="burstvm busybox"\nID=burstvm-busybox\n' >"$r/etc/os-release"
  chmod 0644 "$r/etc/passwd" "$r/etc/group" "$r/etc/os-release"
  # Everything root's but /home/app (1000:1000), without needing to chown:
  # the home is appended with its own owner.
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --exclude=./home/app \
    -cf "$d/layer.tar" -C "$r" .
  tar --owner=1000 --group=1000 --numeric-owner --mtime=@0 --no-recursion \
    -rf "$d/layer.tar" -C "$r" ./home/app
  pack burstvm.local/busybox:1 busybox \
    '{"Cmd":["sh"],"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin","BURSTVM_IMAGE=busybox"],"WorkingDir":"/"}'
}

# Debian bookworm minbase with python3-minimal, owners as Debian made them.
debian_image() {
  command -v mmdebstrap >/dev/null || { echo "build-images.sh: --debian needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 1; }
  local d="$work/debian-python" r="$work/debian-python/rootfs"
  rm -rf "$d" && mkdir -p "$d"
  # No docs, man pages or translations (copyrights kept).
  SOURCE_DATE_EPOCH=0 mmdebstrap --quiet --variant=minbase --include=python3-minimal \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm "$r" >&2
  # Nothing of this machine: no device nodes (a container's /dev is mounted
  # over), no hostname or resolv.conf (the runtime provides them).
  find "$r/dev" -mindepth 1 -delete
  rm -f "$r/etc/hostname" "$r/etc/resolv.conf"
  tar --sort=name --numeric-owner --mtime=@0 -cf "$d/layer.tar" -C "$r" .
  rm -rf "$r"
  pack burstvm.local/debian-python:1 debian-python \
    '{"Cmd":["python3"],"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"WorkingDir":"/"}'
}

app_image burstvm.local/app:1 /app app app=0 app-exit3=3
app_image burstvm.local/pause:1 /pause pause pause=0
busybox_image
built="$out/app.tar $out/pause.tar $out/busybox.tar"
if [ "$debian" = 1 ]; then
  debian_image
  built="$built $out/debian-python.tar"
fi
echo "$built"
