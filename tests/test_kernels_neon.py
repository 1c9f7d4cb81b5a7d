"""The C library's NEON path (csrc/kernels_neon.c), which x86-64 machines never compile: the whole library and the
C driver tests/c/neon_check.c built for AArch64 and run; the driver compares every NEON kernel with its own naive
oracles and with the scalar path (bit for bit where the library promises it; see the driver's header).

On x86-64 Linux it is cross-compiled with aarch64-linux-gnu-gcc (static, so qemu needs no sysroot) and run under
`qemu-aarch64 -cpu max`; scripts/install_system_deps.sh installs both, and a missing one fails the test. On AArch64
Linux it is compiled and run natively. Two builds: -march=armv8-a (the vmull_s8 / vpadalq_s16 kernel) and
-march=armv8.2-a+dotprod (vdotq_s32); the disassembly of kernels_neon.o shows which one each build holds.
The dotprod build also runs on a CPU without the dot-product instructions (qemu's Cortex-A57), where the library
must offer the scalar path instead. Compiler flags are setup.py's. About 6 s on the 2-core x86 machine.
"""

from __future__ import annotations

import ast
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
DRIVER = ROOT / "tests" / "c" / "neon_check.c"
INSTALL_HINT = "run scripts/install_system_deps.sh (installs gcc-aarch64-linux-gnu and qemu-user)"
# -march -> the kernel the driver reports (its KERNEL_NAME)
VARIANTS = {"armv8-a": "vmull_s8/vpadalq_s16", "armv8.2-a+dotprod": "vdotq_s32 (dotprod)"}
X86 = sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")
ARM = sys.platform.startswith("linux") and platform.machine().lower() in ("aarch64", "arm64")


def _setup_flags() -> list[str]:
    """setup.py's UNIX_FLAGS, read without running setup.py."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "UNIX_FLAGS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no UNIX_FLAGS")


def _toolchain() -> tuple[str, str, list[str], list[str]]:
    """(compiler, objdump, runner prefix, extra link flags) for this host."""
    if X86:
        tools = {
            t: shutil.which(t) for t in ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-objdump", "qemu-aarch64")
        }
        missing = [t for t, p in tools.items() if p is None]
        if missing:
            pytest.fail(f"{', '.join(missing)} not found: {INSTALL_HINT}", pytrace=False)
        cc, objdump, qemu = tools.values()
        return cc, objdump, [qemu, "-cpu", "max"], ["-static"]
    if ARM:
        cc, objdump = shutil.which("gcc") or shutil.which("cc"), shutil.which("objdump")
        if cc is None or objdump is None:
            pytest.fail("a C compiler (gcc) and objdump are needed to test the NEON path", pytrace=False)
        return cc, objdump, [], []
    pytest.skip(
        f"the NEON check runs on x86-64 Linux (under qemu) or AArch64 Linux, not {sys.platform} {platform.machine()}"
    )


def _cpu_has_dotprod() -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("Features") and "asimddp" in line.split() for line in info.splitlines())


def _run(cmd: list[str], what: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env())
    assert proc.returncode == 0, (
        f"{what} failed (exit {proc.returncode}):\n$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    )
    return proc


def _env() -> dict[str, str]:
    # the library's BITNETLM_* settings (ISA, threads, prefetch) of the calling process do not apply to the driver
    return {k: v for k, v in os.environ.items() if not k.startswith("BITNETLM_")}


@pytest.mark.parametrize("march", list(VARIANTS))
def test_neon_path_matches_oracles(tmp_path, march):
    cc, objdump, runner, link = _toolchain()
    native_without_dotprod = ARM and "dotprod" in march and not _cpu_has_dotprod()
    flags = [*_setup_flags(), f"-march={march}", "-pthread", f"-I{CSRC}"]
    sources = sorted(str(p) for p in CSRC.glob("*.c"))  # setup.py's sources: the whole library
    assert any(s.endswith("kernels_neon.c") for s in sources)

    # which kernel the build holds: sdot only in the dotprod build, smull/smlal only in the plain one
    obj = tmp_path / "kernels_neon.o"
    _run([cc, *flags, "-c", str(CSRC / "kernels_neon.c"), "-o", str(obj)], "compiling kernels_neon.c")
    asm = _run([objdump, "-d", str(obj)], "objdump").stdout
    mnemonics = [line.split("\t")[2].split()[0] for line in asm.splitlines() if line.count("\t") >= 2]
    sdot = sum(m == "sdot" for m in mnemonics)
    smull = sum(m.startswith(("smull", "smlal")) for m in mnemonics)
    if "dotprod" in march:
        assert sdot > 0 and smull == 0, (march, sdot, smull)
    else:
        assert sdot == 0 and smull > 0, (march, sdot, smull)

    exe = tmp_path / f"neon_check-{march}"
    build = _run(
        [cc, *flags, *link, *sources, str(DRIVER), "-o", str(exe), "-lm"], f"building the library for {march}"
    )
    # a warning on the ARM build is a finding too (the x86 build is warning-free with the same flags)
    assert "warning" not in build.stderr, build.stderr

    if not native_without_dotprod:
        proc = _run([*runner, str(exe)], f"neon_check ({march})")
        assert "neon_check: OK" in proc.stdout and f"NEON kernel {VARIANTS[march]}" in proc.stdout, (
            proc.stdout
        )
    if "dotprod" in march and (X86 or native_without_dotprod):
        # on an ARMv8.0 CPU (qemu's Cortex-A57) the dotprod build must fall back to scalar, not die on sdot
        old_cpu = [runner[0], "-cpu", "cortex-a57"] if X86 else []
        proc = _run([*old_cpu, str(exe), "--no-dotprod-cpu"], f"neon_check ({march}) without dotprod")
        assert "scalar path selected" in proc.stdout, proc.stdout
