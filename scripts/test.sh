#!/usr/bin/env bash
# Install everything the test suite needs on a fresh machine, fetch the real test assets, run the tests.
# This is the README's test command and what .ci/run calls. GPU tests (marked `gpu`) run on a CUDA machine;
# llama.cpp tests (marked `llamacpp`) need scripts/build_llama_bench.sh's build first; tests marked `opt_in` need
# an asset fetched by name (scripts/fetch_assets.py NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0            # CPU build from local disk (a plain `torch` pulls CUDA)
python3 -m pip install -q -e ".[dev]"
if [ -x scripts/install_system_deps.sh ]; then bash scripts/install_system_deps.sh; fi
python3 scripts/fetch_assets.py
python3 -m pytest -m "not gpu and not llamacpp and not opt_in" "$@"
