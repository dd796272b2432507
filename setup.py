"""Build script: CMake (driven here, pybind11's cmake_example pattern) builds pyscore._C and, when nvcc is
present, pyscore._C_cuda; grpcio-tools generates the gRPC code from proto/ into pyscore/_proto. The metadata and
dependencies are in pyproject.toml; this file says what the wheel holds: every pyscore package (the generated
ones included, with the .proto files and the descriptor set), both extension modules, and server/ installed as
`pyscore_server` (a top-level `server` would shadow users' own modules)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Command, Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

ROOT = Path(__file__).resolve().parent


def generate_proto() -> None:
    """protoc via grpcio-tools: proto/pyscore/v1/*.proto -> pyscore/_proto/pyscore/v1/*_pb2*.py, with a copy of
    each .proto beside its generated code (clients in other languages take the contract from the wheel)."""
    protos = sorted((ROOT / "proto").rglob("*.proto"))
    if not protos:
        return
    from grpc_tools import protoc  # build-time dependency

    out = ROOT / "pyscore" / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    # descriptors.binpb keeps the .proto comments, which the server's reflection hands to grpcurl describe
    args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", f"--descriptor_set_out={out / 'descriptors.binpb'}", "--include_source_info",
            *map(str, protos)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    for proto in protos:
        shutil.copyfile(proto, out / proto.relative_to(ROOT / "proto"))
    for d in [out, *[p for p in out.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    _root_generated_imports(out)


def proto_packages() -> list[str]:
    """The packages generate_proto writes (pyscore._proto, pyscore._proto.pyscore, ...), known from proto/ alone:
    setup() needs them before anything is generated."""
    dirs = {p.parent.relative_to(ROOT / "proto") for p in (ROOT / "proto").rglob("*.proto")}
    parents = {parent for d in dirs for parent in [d, *d.parents]}
    return sorted(".".join(("pyscore", "_proto", *d.parts)) for d in parents)


def packages() -> list[str]:
    """pyscore and its subpackages, the generated ones, and server/ as pyscore_server (its subpackages too)."""
    ours = find_packages(include=["pyscore", "pyscore.*"], exclude=["pyscore._proto", "pyscore._proto.*"])
    server = ["pyscore_server" + name.removeprefix("server") for name in find_packages(include=["server", "server.*"])]
    return sorted({*ours, *proto_packages(), *server})


def _root_generated_imports(out: Path) -> None:
    """protoc writes absolute imports of the proto packages (`from pyscore.v1 import scorer_pb2`), which would
    resolve against the real `pyscore` package; re-root them under pyscore._proto so the generated code
    imports as `pyscore._proto.pyscore.v1` without touching sys.path."""
    import re

    generated = [*out.rglob("*_pb2*.py"), *out.rglob("*_pb2*.pyi")]
    packages = {".".join(f.parent.relative_to(out).parts) for f in generated} - {""}
    if not packages:
        return
    names = "|".join(re.escape(p) for p in sorted(packages, key=len, reverse=True))
    pattern = re.compile(rf"^(from|import) ({names})(\.| )", re.MULTILINE)
    for f in generated:
        text = f.read_text()
        fixed = pattern.sub(r"\1 pyscore._proto.\2\3", text)
        if fixed != text:
            f.write_text(fixed)


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self) -> None:
        # setuptools clears self.inplace while building (it copies afterwards); remember what was asked.
        self.pyscore_inplace = bool(self.inplace)
        super().run()

    def copy_extensions_to_source(self) -> None:
        # In-place builds: CMake already wrote _C (and _C_cuda) into pyscore/, so there is nothing to copy.
        if not self.pyscore_inplace:
            super().copy_extensions_to_source()

    def build_extension(self, ext: Extension) -> None:
        generate_proto()
        # Both modules land beside pyscore/__init__.py; setuptools only knows about _C, so for in-place builds
        # write there directly rather than relying on its copy step (which would skip _C_cuda).
        out_dir = ROOT / "pyscore" if self.pyscore_inplace else Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_temp = Path(self.build_temp).resolve()
        build_temp.mkdir(parents=True, exist_ok=True)
        import pybind11

        cfg = ["-G", "Ninja", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}", f"-DPython_EXECUTABLE={sys.executable}",
               f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", "-DCMAKE_BUILD_TYPE=Release"]
        # Always explicit: CMake caches options, so a PYSCORE_NO_CUDA build would otherwise stick to later ones.
        cfg.append(f"-DPYSCORE_BUILD_CUDA={'OFF' if os.environ.get('PYSCORE_NO_CUDA') else 'ON'}")
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(["cmake", str(ROOT), *cfg], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_temp, check=True)


def generating_proto_first(command: type[Command]) -> type[Command]:
    """`command` that generates the gRPC code before it runs: egg_info (which sdist and wheel builds run first)
    lists the generated packages' files, build_py copies them."""

    class WithProto(command):  # type: ignore[valid-type, misc]
        def run(self) -> None:
            generate_proto()
            super().run()

    return WithProto


setup(
    packages=packages(),
    package_dir={"pyscore_server": "server"},
    package_data={name: ["*.proto", "*.pyi", "descriptors.binpb"] for name in proto_packages()},
    ext_modules=[CMakeExtension("pyscore._C")],
    cmdclass={"build_ext": CMakeBuild, "build_py": generating_proto_first(build_py),
              "egg_info": generating_proto_first(egg_info)},
)
