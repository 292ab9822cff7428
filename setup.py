"""Build hook: compile the protocols in the repository (``<package>/proto/*.proto``, e.g. the
gRPC KV transport's) into Python modules beside them before the packages are built.

Everything else about the package is in ``pyproject.toml``. ``build_py`` runs for wheels and for
editable installs (``pip install -e .``) alike; ``grpcio-tools`` comes from the build
requirements. The generated ``*_pb2.py`` / ``*_pb2_grpc.py`` are git-ignored.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _outputs(proto: Path) -> list[Path]:
    return [proto.with_name(f"{proto.stem}{suffix}.py") for suffix in ("_pb2", "_pb2_grpc")]


def generate_protos() -> None:
    """Run ``grpc_tools.protoc`` on every ``.proto``. Paths are relative to the repository root,
    so the generated modules import each other as ``<package>.proto.<name>_pb2``."""
    protos = sorted(ROOT.glob("*/proto/*.proto"))
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        stale = [
            p
            for p in protos
            for out in _outputs(p)
            if not out.exists() or out.stat().st_mtime < p.stat().st_mtime
        ]
        if stale:
            raise RuntimeError(
                "grpcio-tools is needed to generate the Python modules of "
                f"{', '.join(p.name for p in stale)}: pip install grpcio-tools (it is a build "
                "requirement in pyproject.toml)"
            ) from exc
        return  # generated earlier and up to date
    for proto in protos:
        rel = proto.relative_to(ROOT).as_posix()
        args = [
            "grpc_tools.protoc",
            f"--proto_path={ROOT}",
            f"--python_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            rel,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {rel}")


class BuildPyWithProtos(build_py):
    """``build_py`` that generates the protocol modules first (also in editable mode, where
    the base command copies nothing and the source tree is what gets imported)."""

    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
