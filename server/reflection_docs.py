"""Server reflection, both grpc.reflection.v1 and v1alpha, carrying the .proto comments.

- Comments: generated *_pb2 modules drop source_code_info, so by default `grpcurl describe` shows bare fields;
  `DocumentedPool` wraps the default descriptor pool and adds the comments from pyscore/_proto/descriptors.binpb
  (written by the build with --include_source_info) to every file descriptor that reflection hands out.
  Without that file it serves what the default pool has.
- Method symbols: protobuf's pool does not resolve `pkg.Service.Method`, which grpcurl asks for in
  `describe pyscore.v1.Scorer.Score`; the pool answers with the service's file.
- v1: grpcio-reflection only implements v1alpha. The two versions are the same messages under another package
  name, so one servicer answers both, and the v1 file descriptor (for describing the reflection service itself)
  is v1alpha's with the package renamed.
- `only`: a pool restricted to some packages, for the reflection that callers without a token get (just the
  health service: see server/security.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

from pyscore import _proto

# Beside the generated code, in a checkout (make build) as in an installed wheel.
DESCRIPTOR_SET = Path(_proto.__file__).resolve().parent / "descriptors.binpb"
V1ALPHA = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_SERVICES = (V1, V1ALPHA)


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto, made from the v1alpha descriptor (same messages and fields)."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    proto.ClearField("options")  # v1alpha's are deprecated=true and its Java/Go packages
    for message in proto.message_type:
        for f in message.field:
            if f.type_name:
                f.type_name = f.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    return proto


class _DocumentedFile:
    def __init__(self, descriptor: Any, pool: DocumentedPool) -> None:
        self._descriptor = descriptor
        self._pool = pool
        self.name: str = descriptor.name

    @property
    def dependencies(self) -> list[_DocumentedFile]:
        return [_DocumentedFile(d, self._pool) for d in self._descriptor.dependencies]

    def CopyToProto(self, proto: descriptor_pb2.FileDescriptorProto) -> None:
        self._descriptor.CopyToProto(proto)
        if self.name in self._pool.source_info:
            proto.source_code_info.CopyFrom(self._pool.source_info[self.name])


class DocumentedPool:
    """Quacks like the DescriptorPool that grpc_reflection's servicer reads. `only`: answer for symbols of
    these packages (and their files) alone; everything else is not found."""

    def __init__(self, pool: descriptor_pool.DescriptorPool | None = None, path: Path = DESCRIPTOR_SET,
                 only: Iterable[str] | None = None) -> None:
        self._pool = pool or descriptor_pool.Default()
        self._v1 = descriptor_pool.DescriptorPool()
        self._v1.AddSerializedFile(_v1_file().SerializeToString())
        self._only = tuple(f"{p}." for p in only) if only is not None else None
        self.source_info: dict[str, descriptor_pb2.SourceCodeInfo] = {}
        if path.exists():
            files = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())
            self.source_info = {f.name: f.source_code_info for f in files.file if f.HasField("source_code_info")}

    def _allowed(self, symbol: str) -> None:
        if self._only is not None and not symbol.startswith(self._only):
            raise KeyError(symbol)

    def _find_file(self, symbol: str) -> Any:
        for pool in (self._pool, self._v1):
            try:
                return pool.FindFileContainingSymbol(symbol)
            except KeyError:
                pass
        service, _, method = symbol.rpartition(".")
        for pool in (self._pool, self._v1):
            try:
                if method in pool.FindServiceByName(service).methods_by_name:
                    return pool.FindFileContainingSymbol(service)
            except KeyError:
                pass
        raise KeyError(symbol)

    def FindFileByName(self, name: str) -> _DocumentedFile:
        try:
            found = self._pool.FindFileByName(name)
        except KeyError:
            found = self._v1.FindFileByName(name)
        self._allowed(found.package + ".")
        return _DocumentedFile(found, self)

    def FindFileContainingSymbol(self, symbol: str) -> _DocumentedFile:
        self._allowed(symbol)
        return _DocumentedFile(self._find_file(symbol), self)

    def FindMessageTypeByName(self, name: str) -> Any:
        self._allowed(name)
        return self._pool.FindMessageTypeByName(name)

    def __getattr__(self, name: str) -> Any:  # FindExtensionByNumber, FindAllExtensions
        return getattr(self._pool, name)


def reflection_handlers(service_names: Iterable[str], pool: DocumentedPool) -> dict[str, grpc.RpcMethodHandler]:
    """Method path -> handler of ServerReflectionInfo for v1 and v1alpha, listing `service_names` and
    describing what `pool` finds."""
    servicer = reflection.aio.ReflectionServicer(tuple(service_names), pool=pool)  # type: ignore[arg-type]
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    return {f"/{service}/ServerReflectionInfo": handler for service in REFLECTION_SERVICES}


def add_reflection(server: grpc.aio.Server, service_names: Iterable[str], pool: DocumentedPool) -> None:
    """Serve reflection (v1 and v1alpha) of `service_names` plus the reflection services themselves."""
    handlers = reflection_handlers((*service_names, *REFLECTION_SERVICES), pool)
    for service in REFLECTION_SERVICES:
        methods = {"ServerReflectionInfo": handlers[f"/{service}/ServerReflectionInfo"]}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
