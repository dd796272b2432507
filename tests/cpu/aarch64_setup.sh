#!/usr/bin/env bash
# The aarch64 check's tools, from Debian's packages: the cross compiler (g++-aarch64-linux-gnu, which brings the
# aarch64 libstdc++ and libgomp) and qemu-user (qemu-aarch64 runs the result). Installed when missing and this runs
# as root with apt-get; otherwise it says what is missing and exits 0, and tests/ops/test_aarch64.py skips with the
# same reason.
set -euo pipefail
PACKAGES=(g++-aarch64-linux-gnu qemu-user)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "aarch64 check: missing Debian packages (not root, or no apt-get): ${missing[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
