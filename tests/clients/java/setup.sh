#!/usr/bin/env bash
# The Java client test's dependencies, from Debian's packages (grpc-java 1.41 and its runtime, protoc and the
# grpc-java protoc plugin): installed when missing and this runs as root with apt-get; otherwise it says what
# is missing and exits 0, and tests/clients/test_java_client.py skips with the same list.
set -euo pipefail
PACKAGES=(default-jdk-headless libgrpc-java libprotobuf-java libnetty-java libguava-java libperfmark-java
          libgeronimo-annotation-1.3-spec-java
          libgoogle-common-protos-java libgoogle-gson-java protobuf-compiler protobuf-compiler-grpc-java-plugin)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "java client test: missing Debian packages (not root, or no apt-get): ${missing[*]}" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
