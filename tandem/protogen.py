"""Generates the Python stubs of `protos/tandem/v1` into `tandem/v1` and Envoy's descriptor set.

Run by `make protos` (and by `make setup`); the generated files are never committed.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
DESCRIPTOR = ROOT / "build" / "tandem_descriptor.pb"


def include_paths() -> list[str]:
    """Where protoc finds our protos, the well-known types and `google/api/annotations.proto`."""
    import google.api  # googleapis-common-protos ships the .proto files beside its modules
    import grpc_tools

    well_known = resources.files(grpc_tools) / "_proto"
    googleapis = Path(google.api.__file__).resolve().parent.parent.parent
    return [str(PROTO_ROOT), str(well_known), str(googleapis)]


def main() -> int:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "tandem" / "v1").glob("*.proto"))
    DESCRIPTOR.parent.mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", *(f"-I{p}" for p in include_paths())]
    args += [f"--python_out={ROOT}", f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}"]
    args += [f"--descriptor_set_out={DESCRIPTOR}", "--include_imports", "--include_source_info", *protos]
    code = protoc.main(args)
    if code != 0:
        print(f"protoc failed with exit code {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
