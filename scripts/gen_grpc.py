"""Regenerate the gRPC Python stubs of bitnetlm/serve/kserve/inference.proto (needs grpcio-tools).

python scripts/gen_grpc.py            # rewrite inference_pb2.py and inference_pb2_grpc.py in place
python scripts/gen_grpc.py --out DIR  # write them under DIR instead (tests compare them to the committed ones)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "bitnetlm/serve/kserve/inference.proto"
STUBS = ("inference_pb2.py", "inference_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    """The stubs, written under `out` (as out/bitnetlm/serve/kserve/...); returns their paths."""
    from grpc_tools import protoc

    # run from the repository root, so the stubs import each other as bitnetlm.serve.kserve.inference_pb2
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = protoc.main(
            ["grpc_tools.protoc", "-I.", f"--python_out={out}", f"--grpc_python_out={out}", PROTO]
        )
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"gen_grpc: protoc failed on {PROTO} (exit status {rc})")
    return [out / Path(PROTO).parent / name for name in STUBS]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the stubs under this directory instead of in place")
    args = ap.parse_args(argv)
    if args.out is not None:
        for p in generate(args.out.resolve()):
            print(p)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for p in generate(Path(tmp)):
            dest = ROOT / Path(PROTO).parent / p.name
            tmp_dest = dest.with_suffix(".py.tmp")
            tmp_dest.write_bytes(p.read_bytes())
            tmp_dest.replace(dest)  # (a temp file, then rename: never a half-written stub)
            print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
