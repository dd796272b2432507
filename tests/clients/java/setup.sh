#!/usr/bin/env bash
# The Java client test's dependencies, from Debian's packages (grpc-java 1.41 and its runtime, protoc and the
# grpc-java protoc plugin): installed when missing and this runs as root with apt-get; otherwise it says what
# is missing and exits 0, and tests/clients/test_java_client.py skips with the same list.
exec "$(dirname "$0")/../../../scripts/debian_packages.sh" "java client test" \
  default-jdk-headless libgrpc-java libprotobuf-java libnetty-java libguava-java libperfmark-java \
  libgeronimo-annotation-1.3-spec-java \
  libgoogle-common-protos-java libgoogle-gson-java protobuf-compiler protobuf-compiler-grpc-java-plugin
