#!/usr/bin/env bash
# Usage: scripts/debian_packages.sh WHAT PACKAGE...
# Test-only tools from Debian's packages: installs those of PACKAGE... that are missing when this runs as root with
# apt-get; otherwise it says what WHAT lacks and exits 0, and the tests that need them skip with the same list.
set -euo pipefail
what=$1
shift
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "$what: missing Debian packages (not root, or no apt-get): ${missing[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
