#!/usr/bin/env bash
# Installs the peer engines that benchmarks/peers.py measures beside vcfslm,
# in their own virtualenv (.venv-peers, ignored by git): OpenVINO GenAI with
# optimum-intel for the IR export, and llama-cpp-python built from its sdist
# with native CPU flags. Never part of `make test` or CI.
# Usage: bash benchmarks/peers-setup.sh   (or: make peers)
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

start=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
if [ ! -f "$VENV/.python-peers" ]; then
  echo "peers: installing ${PINS[*]}"
  "$PY" -m pip install -q "${PINS[@]}"
  # A torchvision pulled in alongside is a CUDA build: it breaks `import
  # transformers` on CPU torch.
  "$PY" -m pip uninstall -q -y torchvision 2>/dev/null || true
  touch "$VENV/.python-peers"
fi
if [ ! -f "$VENV/.llama-cpp" ]; then
  echo "peers: building $LLAMA from its sdist with native CPU flags (about 9 minutes on 2 cores)"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip install -q --no-binary llama-cpp-python --no-cache-dir "$LLAMA"
  touch "$VENV/.llama-cpp"
fi
"$PY" - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "optimum-intel", "openvino", "openvino-genai",
             "gguf", "llama-cpp-python"):
    print(f"peers: {name} {md.version(name)}")
PY
echo "peers: ready in $VENV ($(( $(date +%s) - start )) s)"
