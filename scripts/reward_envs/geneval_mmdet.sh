#!/usr/bin/env bash
# Build a Python environment of its own for reward=geneval detector=mmdet colors=open_clip: the reference's detector
# and colour classifier (yifan123/reward-server@92ac29f README "GenEval" and reward_server/gen_eval.py;
# NVlabs/DiffusionNFT@24af555 flow_grpo/gen_eval.py): mmdetection 2.x with mmcv-full 1.x, Mask2Former Swin-S COCO, and
# open_clip ViT-L-14 `openai`. mmdet 2.x needs mmcv-full 1.x, which does not install beside a current torch: it gets
# its own venv, with the torch the reference pins (2.1.2 + CUDA 12.1); the trainer runs the reward in it (the managed
# reward process: reward.process.python=<venv>/bin/python).
#
# Needs the network (PyPI, download.pytorch.org, download.openmmlab.com, GitHub, open_clip's weights); not run in CI.
# mmcv-full 1.x has no prebuilt wheel for every torch/CUDA pair: where none exists, mim compiles it (tens of minutes,
# needs nvcc). Usage:
#   bash scripts/reward_envs/geneval_mmdet.sh [VENV_DIR] [WEIGHTS_DIR]
#   (defaults: .venv-geneval and ~/.cache/ddpo_tpu/geneval)
# then:  python -m ddpo_tpu.train ... prompts=dataset prompts.path=.../geneval reward=geneval \
#          reward.detector_model=WEIGHTS_DIR/mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.pth \
#          reward.process.python=VENV_DIR/bin/python
set -euo pipefail

VENV=${1:-.venv-geneval}
WEIGHTS=${2:-$HOME/.cache/ddpo_tpu/geneval}
PYTHON=${PYTHON:-python3.10}                 # the reference's 3.10.16
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu121}   # .../whl/cpu for a CPU-only environment
MMDET_REF=${MMDET_REF:-v2.28.2}              # the last 2.x release (the reference: the 2.x branch)
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CKPT=mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco
URL=https://download.openmmlab.com/mmdetection/v2.0/mask2former/$CKPT/${CKPT}_20220504_001756-743b7d99.pth

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip "setuptools<70" wheel
"$VENV/bin/python" -m pip install -q torch==2.1.2 torchvision==0.16.2 --index-url "$TORCH_INDEX"
"$VENV/bin/python" -m pip install -q "numpy<2" openmim "open-clip-torch==2.31.0" pillow pydantic pyyaml
"$VENV/bin/mim" install "mmcv-full==1.7.2"

# mmdetection 2.x from source (its configs/ folder is read next to the package: gen_eval.py's config path)
SRC="$VENV/src/mmdetection"
[ -d "$SRC" ] || git clone --depth 1 --branch "$MMDET_REF" https://github.com/open-mmlab/mmdetection.git "$SRC"
# the reference's README step: let mmdet 2.x accept mmcv-full 1.7.x
sed -i "s/^mmcv_maximum_version = .*/mmcv_maximum_version = '2.3.0'/" "$SRC/mmdet/__init__.py"
"$VENV/bin/python" -m pip install -q -e "$SRC"

# the Mask2Former Swin-S COCO checkpoint (the reference's URL) and open_clip's ViT-L-14 `openai` weights
mkdir -p "$WEIGHTS"
[ -s "$WEIGHTS/$CKPT.pth" ] || curl -fL "$URL" -o "$WEIGHTS/$CKPT.pth"
PYTHONPATH="$REPO" "$VENV/bin/python" - "$WEIGHTS/$CKPT.pth" <<'PY'
import sys
import numpy as np
import open_clip
open_clip.create_model_and_transforms("ViT-L-14", pretrained="openai")  # cached for the runs
from ddpo_tpu.rewards.geneval import DETECTORS
detect = DETECTORS["mmdet"](model=sys.argv[1], device="cpu")
found = detect([np.zeros((256, 256, 3), np.uint8)])[0]
print("mmdet Mask2Former ready:", sum(len(v) for v in found.values()), "raw detections on a black image")
PY
echo "built $VENV: reward.detector=mmdet reward.detector_model=$WEIGHTS/$CKPT.pth" \
  "reward.process.python=$VENV/bin/python"
