#!/usr/bin/env bash
# System packages some tests need (called by scripts/test.sh when present), installed with apt-get when missing:
#   - Debian's chromium for the web chat page test (tests/test_serve_web.py, driven by the `playwright` Python
#     package, no browser download);
#   - on x86-64 hosts, gcc-aarch64-linux-gnu (with its binutils) and qemu-user: tests/test_kernels_neon.py
#     cross-compiles the C library for AArch64 and runs its NEON check under qemu-aarch64.
# Does nothing when everything is present.
set -euo pipefail
PKGS=()
MANUAL=()
if [ ! -x /usr/bin/chromium ]; then
    PKGS+=(chromium)
    MANUAL+=("Chromium (and set BITNET_CHROMIUM=/path/to/chromium)")
fi
case "$(uname -m)" in
x86_64 | amd64)
    if ! command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || ! command -v aarch64-linux-gnu-objdump >/dev/null 2>&1; then
        PKGS+=(gcc-aarch64-linux-gnu)
        MANUAL+=("an AArch64 cross compiler and binutils (aarch64-linux-gnu-gcc, aarch64-linux-gnu-objdump on PATH)")
    fi
    if ! command -v qemu-aarch64 >/dev/null 2>&1; then
        PKGS+=(qemu-user)
        MANUAL+=("qemu user-mode emulation (qemu-aarch64 on PATH)")
    fi
    ;;
esac
if [ "${#PKGS[@]}" -eq 0 ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    SUDO="sudo"
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps.sh: no apt-get; install:" >&2
    for m in "${MANUAL[@]}"; do echo "  - $m" >&2; done
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q "${PKGS[@]}" >/dev/null
if [ -x /usr/bin/chromium ]; then /usr/bin/chromium --version; fi
if command -v aarch64-linux-gnu-gcc >/dev/null 2>&1; then aarch64-linux-gnu-gcc --version | head -n 1; fi
if command -v qemu-aarch64 >/dev/null 2>&1; then qemu-aarch64 --version | head -n 1; fi
