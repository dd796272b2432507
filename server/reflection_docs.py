"""Server reflection that carries the .proto comments. Generated *_pb2 modules drop source_code_info, so by
default `grpcurl describe` shows bare fields; this pool wraps the default descriptor pool and adds the
comments from pyscore/_proto/descriptors.binpb (written by the build with --include_source_info) to every
file descriptor that reflection hands out. Without that file it serves what the default pool has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool

DESCRIPTOR_SET = Path(__file__).resolve().parents[1] / "pyscore" / "_proto" / "descriptors.binpb"


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
    """Quacks like the DescriptorPool that grpc_reflection's servicer reads."""

    def __init__(self, pool: descriptor_pool.DescriptorPool | None = None, path: Path = DESCRIPTOR_SET) -> None:
        self._pool = pool or descriptor_pool.Default()
        self.source_info: dict[str, descriptor_pb2.SourceCodeInfo] = {}
        if path.exists():
            files = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())
            self.source_info = {f.name: f.source_code_info for f in files.file if f.HasField("source_code_info")}

    def FindFileByName(self, name: str) -> _DocumentedFile:
        return _DocumentedFile(self._pool.FindFileByName(name), self)

    def FindFileContainingSymbol(self, symbol: str) -> _DocumentedFile:
        return _DocumentedFile(self._pool.FindFileContainingSymbol(symbol), self)

    def __getattr__(self, name: str) -> Any:  # FindMessageTypeByName, FindExtensionByNumber, FindAllExtensions
        return getattr(self._pool, name)
