#!/usr/bin/env bash
# Installs the peer engines that benchmarks/peers.py measures beside vcfslm,
# in their own virtualenv (.venv-peers, ignored by git): OpenVINO GenAI with
# optimum-intel for the IR export, and llama-cpp-python built from its sdist
# with native CPU flags. `make test` installs the first part alone (prebuilt wheels, about a
# minute), so CI checks OpenVINO's equivalence; llama.cpp's ~9-minute build is `make peers` only.
# Usage: bash benchmarks/peers-setup.sh            (or: make peers)
#        bash benchmarks/peers-setup.sh --wheels   (OpenVINO GenAI and gguf, no llama.cpp build)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${PEERS_VENV:-.venv-peers}
PY="$VENV/bin/python"
# optimum-intel 2.2 needs transformers < 5.6, hence a venv of its own; torch is
# pinned as everywhere (an open range pulls a multi-GB CUDA build).
PINS=(torch==2.13.0 "transformers>=5.5,<5.6" optimum-intel==2.2.0
      openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0
      gguf==0.19.0 tokenizers safetensors numpy)
LLAMA=llama-cpp-python==0.3.36
WHEELS_ONLY=
case "${1:-}" in
  "") ;;
  --wheels) WHEELS_ONLY=1 ;;
  *) echo "usage: $0 [--wheels]" >&2; exit 2 ;;
esac

# UV: the uv that `make` installs (.venv-uv), which installs these wheels in seconds where pip
# takes minutes; without it, pip.
UV=${UV:-}
start=$(date +%s)
if [ -n "$UV" ]; then
  test -x "$PY" || "$UV" venv -q --seed --python "$PYTHON" "$VENV"
else
  test -x "$PY" || "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
fi
if [ ! -f "$VENV/.python-peers" ]; then
  echo "peers: installing ${PINS[*]}"
  # A torchvision pulled in alongside is a CUDA build: it breaks `import transformers` on CPU
  # torch, so it goes.
  if [ -n "$UV" ]; then
    # uv reads no pip configuration: pip's find-links (where the CPU torch wheel lies) are passed on.
    "$UV" pip install -q ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} --python "$PY" "${PINS[@]}"
    "$UV" pip uninstall -q --python "$PY" torchvision 2>/dev/null || true
  else
    "$PY" -m pip install -q "${PINS[@]}"
    "$PY" -m pip uninstall -q -y torchvision 2>/dev/null || true
  fi
  touch "$VENV/.python-peers"
fi
if [ -z "$WHEELS_ONLY" ] && [ ! -f "$VENV/.llama-cpp" ]; then
  echo "peers: building $LLAMA from its sdist with native CPU flags (about 9 minutes on 2 cores)"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip install -q --no-binary llama-cpp-python --no-cache-dir "$LLAMA"
  touch "$VENV/.llama-cpp"
fi
"$PY" - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "optimum-intel", "openvino", "openvino-genai",
             "gguf", "llama-cpp-python"):
    try:
        print(f"peers: {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"peers: {name} not installed (bash benchmarks/peers-setup.sh builds it)")
PY
echo "peers: ready in $VENV ($(( $(date +%s) - start )) s)"
