"""Run the Dockerfile's steps without Docker: its COPY, ARG, ENV, WORKDIR and RUN steps in a clean virtual environment
in a temporary directory (apt-get steps are the base image's business and are skipped), then its CMD, checked by a
completion request once /health answers. Exit status 0 when every step worked.

    python scripts/check_dockerfile.py [--dockerfile Dockerfile] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def steps(path: Path) -> list[tuple[str, str]]:
    """(instruction, argument) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            op, _, arg = buf.partition(" ")
            out.append((op.upper(), arg.strip()))
            buf = ""
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"CMD exited with status {proc.returncode} before /health answered")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"/health did not answer 200 within {timeout:g} s")


def complete(url: str, key: str | None) -> str:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["text"]


def run(dockerfile: Path, keep: bool) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bitnet-docker-check-"))
    try:
        venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {
            **os.environ,
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "VIRTUAL_ENV": str(venv),
        }
        env.pop("PYTHONPATH", None)
        work = tmp / "root"
        work.mkdir()
        cmd = None
        for op, arg in steps(dockerfile):
            if op == "WORKDIR":
                work = tmp / "root" / arg.lstrip("/")
                work.mkdir(parents=True, exist_ok=True)
            elif op == "COPY":
                *srcs, dst = shlex.split(arg)
                target = work / dst
                for src in srcs:
                    s = ROOT / src
                    d = target / s.name if dst.endswith("/") or len(srcs) > 1 or dst == "." else target
                    if s.is_dir():
                        shutil.copytree(s, d, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
                    else:
                        d.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(s, d)
            elif op == "ARG":
                name, _, default = arg.partition("=")
                env.setdefault(name, default)
            elif op == "ENV":
                env.update(dict(kv.split("=", 1) for kv in shlex.split(arg)))
            elif op == "RUN":
                if arg.startswith("apt-get"):
                    print(f"skip (system packages): RUN {arg}", flush=True)
                    continue
                print(f"RUN {arg}", flush=True)
                subprocess.run(["sh", "-c", arg], cwd=work, env=env, check=True)
            elif op == "CMD":
                cmd = json.loads(arg)
        if cmd is None:
            raise RuntimeError("the Dockerfile has no CMD")
        port = free_port()
        env.update(BITNET_HOST="127.0.0.1", BITNET_PORT=str(port))
        print(f"CMD {cmd} on port {port}", flush=True)
        proc = subprocess.Popen(cmd, cwd=work, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, 300)
            print(f"completion: {complete(url, env.get('BITNET_API_KEY'))!r}", flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    finally:
        if keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dockerfile", type=Path, default=ROOT / "Dockerfile")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    a = p.parse_args()
    try:
        run(a.dockerfile, a.keep)
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
        print(f"check_dockerfile: error: {e}", file=sys.stderr)
        return 1
    print("check_dockerfile: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
