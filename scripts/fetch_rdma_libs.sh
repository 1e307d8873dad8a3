#!/usr/bin/env bash
# Unpack rdma-core's libibverbs and the netlink libraries it needs into DIR (no root: the
# Debian packages are downloaded and extracted, not installed). Mooncake's transfer-engine
# wheels link against them even for TCP; xllm_py/pd/transfer.py loads them from DIR.
# Usage: scripts/fetch_rdma_libs.sh DIR
set -euo pipefail
dir="${1:?usage: fetch_rdma_libs.sh DIR}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null 2>&1)
mkdir -p "$dir"
for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
for lib in libnl-3.so.200 libnl-route-3.so.200 libibverbs.so.1; do
  cp -L "$(find "$tmp/root" -name "$lib" | head -n 1)" "$dir/$lib"
done
echo "rdma-core libraries in $dir"
