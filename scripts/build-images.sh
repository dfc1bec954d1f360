#!/usr/bin/env bash
# Builds the OCI image tarballs burstvm's containerd tests and `bench startup
# --via cri` import with `ctr image import` (nothing is pulled from a registry):
#   OUT/app.tar    burstvm.local/app:1    /app (exits 0), /app-exit3 (exits 3); entrypoint /app
#   OUT/pause.tar  burstvm.local/pause:1  /pause (exits 0): the CRI sandbox image
# Each file is an app payload for the built-in agent: the header "BVMAPP01" and a
# little-endian u32 exit status (docs/guest.md), then deterministic filler.
# Deterministic: the same script gives byte-identical tarballs.
set -euo pipefail
out=${1:?usage: build-images.sh OUTDIR}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

payload() { # status bytes-of-filler
  printf 'BVMAPP01'
  printf "\\x$(printf %02x "$1")\\x00\\x00\\x00"
  head -c "$2" /dev/zero | tr '\0' 'b'
}

sha() { sha256sum "$1" | cut -d' ' -f1; }

# image NAME ENTRYPOINT FILE=STATUS...
image() {
  local name=$1 entry=$2 tarname=$3
  shift 3
  local d="$work/$tarname"
  rm -rf "$d" && mkdir -p "$d/rootfs" "$d/oci/blobs/sha256"
  for f in "$@"; do
    payload "${f#*=}" 1012 >"$d/rootfs/${f%=*}"
    chmod 0755 "$d/rootfs/${f%=*}"
  done
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf "$d/layer.tar" -C "$d/rootfs" .
  gzip -9 -n -c "$d/layer.tar" >"$d/layer.tar.gz"
  local diff layer lsize
  diff=$(sha "$d/layer.tar")
  layer=$(sha "$d/layer.tar.gz")
  lsize=$(stat -c %s "$d/layer.tar.gz")
  cp "$d/layer.tar.gz" "$d/oci/blobs/sha256/$layer"
  printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":["%s"],"WorkingDir":"/"},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$entry" "$diff" >"$d/config.json"
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

image burstvm.local/app:1 /app app app=0 app-exit3=3
image burstvm.local/pause:1 /pause pause pause=0
echo "$out/app.tar $out/pause.tar"
