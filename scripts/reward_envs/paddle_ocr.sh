#!/usr/bin/env bash
# Build a Python environment of its own for reward=ocr recognizer=paddle: PaddleOCR 2.x as flow_grpo calls it
# (yifan123/flow_grpo@ac4c86e README "OCR": paddlepaddle(-gpu) 2.6.2 + paddleocr 2.9.1; flow_grpo/ocr.py builds
# PaddleOCR(use_angle_cls=False, lang="en", use_gpu=..., show_log=False)). Paddle does not install beside a current
# torch, so it gets its own venv; the trainer then runs the reward in it (the managed reward process:
# reward.process.python=<venv>/bin/python) or you install paddleocr into the trainer's environment yourself.
#
# Needs the network (PyPI and Paddle's model download); not run in CI. Usage:
#   bash scripts/reward_envs/paddle_ocr.sh [VENV_DIR] [cpu|gpu]      # default .venv-paddle-ocr, cpu
# then:  python -m ddpo_tpu.train ... reward=ocr reward.recognizer=paddle reward.process.python=VENV_DIR/bin/python
set -euo pipefail

VENV=${1:-.venv-paddle-ocr}
KIND=${2:-cpu}
PYTHON=${PYTHON:-python3}   # Paddle 2.6.2 publishes wheels for CPython 3.8-3.12
REPO=$(cd "$(dirname "$0")/../.." && pwd)

case "$KIND" in
  cpu) PADDLE="paddlepaddle==2.6.2" ;;
  gpu) PADDLE="paddlepaddle-gpu==2.6.2" ;;  # flow_grpo's README; CUDA 11.8/12.x runtime from the machine
  *) echo "paddle_ocr.sh: the second argument is cpu or gpu, not '$KIND'" >&2; exit 2 ;;
esac

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# paddleocr 2.9.1 (the 2.x API the reference calls: PaddleOCR(use_gpu=..., show_log=...), ocr(image, cls=False);
# 3.x removed both). numpy < 2: paddle 2.6's own pin.
"$VENV/bin/python" -m pip install -q "$PADDLE" "paddleocr==2.9.1" "numpy<2"
# what ddpo_tpu's reward server imports in that environment (the package itself comes through PYTHONPATH)
"$VENV/bin/python" -m pip install -q pillow pydantic pyyaml

# download the English detection + recognition models now (into ~/.paddleocr), so a run needs no network
PYTHONPATH="$REPO" "$VENV/bin/python" - <<'PY'
from paddleocr import PaddleOCR
import numpy as np
ocr = PaddleOCR(use_angle_cls=False, lang="en", use_gpu=False, show_log=False)
print("paddleocr ready:", ocr.ocr(np.full((64, 256, 3), 255, np.uint8), cls=False))
from ddpo_tpu.rewards.ocr import resolve_recognizer
blank = np.full((64, 256, 3), 255, np.uint8)
print("ddpo_tpu recognizer=paddle:", resolve_recognizer("paddle", use_gpu=False)([blank]))
PY
echo "built $VENV: reward.recognizer=paddle reward.process.python=$VENV/bin/python"
