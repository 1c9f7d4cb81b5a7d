#!/usr/bin/env bash
# System packages some tests need (called by scripts/test.sh when present): Debian's chromium for the
# web chat page test (tests/test_serve_web.py, driven by the `playwright` Python package, no browser download).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    SUDO="sudo"
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps.sh: no apt-get; install Chromium and set BITNET_CHROMIUM=/path/to/chromium" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q chromium >/dev/null
/usr/bin/chromium --version
