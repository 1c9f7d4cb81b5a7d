#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-tokenize and llama-simple (CPU only) from the llama.cpp tree vendored in the
# llama-cpp-python sdist on PyPI, the one route to llama.cpp's source from machines that reach PyPI but not GitHub.
# benchmarks/cpu_peer.py runs llama-bench; tests/test_gguf_llamacpp.py (pytest marker `llamacpp`) loads the GGUF
# files we write with llama-tokenize (the tokenizer) and llama-simple (greedy generation).
#
#   scripts/build_llama_bench.sh [DEST]     (default DEST: .assets/llama.cpp, git-ignored)
#
# Result: DEST/bin/{llama-bench,llama-tokenize,llama-simple}, statically linked against llama/ggml (only libc,
# libstdc++ and libgomp stay shared), and DEST/COMMIT, the llama.cpp commit they were built from.
# Idempotent: the sdist is downloaded once (DEST/src, or LCP_SDIST_DIR if it already holds the tarball), unpacked
# once, and the cmake build is incremental. Environment: LCP_VERSION (default 0.3.36), JOBS (default 2).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$REPO_ROOT/.assets/llama.cpp}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
LCP_VERSION="${LCP_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
SDIST_DIR="${LCP_SDIST_DIR:-$DEST/src}"
SDIST="$SDIST_DIR/llama_cpp_python-$LCP_VERSION.tar.gz"
SRC_PARENT="$DEST/src"
SRC="$SRC_PARENT/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
BUILD="$DEST/build"

fetch_sdist() {
    if [[ -f "$SDIST" ]]; then
        echo "sdist: $SDIST (already there)"
        return
    fi
    mkdir -p "$SDIST_DIR"
    local tmp
    tmp="$(mktemp -d)"
    python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LCP_VERSION" -d "$tmp"
    mv "$tmp/llama_cpp_python-$LCP_VERSION.tar.gz" "$SDIST"
    rm -rf "$tmp"
    echo "sdist: $SDIST (downloaded)"
}

unpack_sdist() {
    if [[ -f "$SRC/CMakeLists.txt" ]]; then
        echo "source: $SRC (already unpacked)"
        return
    fi
    mkdir -p "$SRC_PARENT"
    # Unpack beside and rename, so an interrupted tar never leaves a half tree that looks complete.
    local tmp
    tmp="$(mktemp -d "$SRC_PARENT/unpack.XXXXXX")"
    tar xzf "$SDIST" -C "$tmp"
    rm -rf "$SRC_PARENT/llama_cpp_python-$LCP_VERSION"
    mv "$tmp/llama_cpp_python-$LCP_VERSION" "$SRC_PARENT/"
    rm -rf "$tmp"
    echo "source: $SRC (unpacked)"
}

# The sdist has no .git; its CHANGELOG names the llama.cpp commit it vendors ("update llama.cpp to
# ggml-org/llama.cpp@<hash>"), the first such line under this version's heading.
vendored_commit() {
    local changelog="$SRC_PARENT/llama_cpp_python-$LCP_VERSION/CHANGELOG.md"
    awk -v ver="## [$LCP_VERSION]" '
        index($0, ver) == 1 { inside = 1; next }
        inside && /^## \[/ { exit }
        inside && match($0, /llama\.cpp@[0-9a-f]+/) { print substr($0, RSTART + 10, RLENGTH - 10); exit }
    ' "$changelog"
}

configure() {
    local commit
    commit="$(vendored_commit)"
    commit="${commit:-unknown}"
    echo "llama.cpp commit (from the sdist's CHANGELOG): $commit"
    # LLAMA_BUILD_COMMIT/NUMBER are passed because git-vars would otherwise ask git, and under a checkout (DEST
    # inside this repository) git answers with this repository's commit. The build number is not recoverable
    # without llama.cpp's history: 0.
    # Tools on (llama-bench and llama-tokenize live there) and examples on (llama-simple); only those three targets
    # are built. Tests, server and the unified app off; no OpenSSL (llama-common's downloader is not used); static
    # so the binaries stand alone.
    local generator=()
    if command -v ninja >/dev/null; then
        generator=(-G Ninja)
    fi
    cmake -S "$SRC" -B "$BUILD" "${generator[@]}" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=ON \
        -DGGML_CPU=ON \
        -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENCL=OFF -DGGML_RPC=OFF \
        -DGGML_BACKEND_DL=OFF \
        -DLLAMA_BUILD_COMMON=ON \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_COMMIT="$commit" \
        -DLLAMA_BUILD_NUMBER=0
}

TARGETS=(llama-bench llama-tokenize llama-simple)

build() {
    local start end
    start="$(date +%s)"
    cmake --build "$BUILD" --target "${TARGETS[@]}" -j "$JOBS"
    end="$(date +%s)"
    echo "build: $((end - start)) s"
}

install_binaries() {
    mkdir -p "$DEST/bin"
    # Copy to a temporary name and rename, so a reader never sees a half-written binary.
    local t
    for t in "${TARGETS[@]}"; do
        cp "$BUILD/bin/$t" "$DEST/bin/.$t.tmp"
        mv "$DEST/bin/.$t.tmp" "$DEST/bin/$t"
        echo "binary: $DEST/bin/$t"
    done
    echo "$(vendored_commit)" > "$DEST/.COMMIT.tmp"
    mv "$DEST/.COMMIT.tmp" "$DEST/COMMIT"
}

command -v cmake >/dev/null || { echo "cmake not found (scripts/install_system_deps.sh)" >&2; exit 1; }
fetch_sdist
unpack_sdist
configure
build
install_binaries
ldd "$DEST/bin/llama-bench" || true
