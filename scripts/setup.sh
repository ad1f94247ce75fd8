#!/usr/bin/env bash
# Create (or reuse) a venv with pinned requirements and ddpo_tpu installed in editable mode.
#   bash scripts/setup.sh             .venv from requirements.txt: torch 2.9 + torch_xla 2.9 (XLA, SPMD, eager, distributed)
#   bash scripts/setup.sh --torchtpu  .venv-torchtpu from requirements-torchtpu.txt: torch 2.15 + TorchTPU + libtpu
#                                     (the distributed execution on TPU VMs; eager and distributed on CPU/CUDA too)
# Reuses a venv when its lockfile, pyproject.toml and this script have not changed (there is no download cache on CI
# machines: a fresh install of torch takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
venv=".venv" lock="requirements.txt"
if [[ "${1:-}" == "--torchtpu" ]]; then
  venv=".venv-torchtpu" lock="requirements-torchtpu.txt"
elif [[ -n "${1:-}" ]]; then
  echo "setup: unknown option ${1} (use --torchtpu or nothing)" >&2
  exit 2
fi
stamp="$venv/.ddpo_tpu-requirements.sha256"
want="$(cat "$lock" pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
# ddpo_tpu's own bytecode, for the same reason as the dependencies' (below): an editable install compiles nothing, and
# every process of a test run would compile the package again (~1 CPU-s each); cheap when it is up to date
compile_package() { "$venv/bin/python" -m compileall -q ddpo_tpu >/dev/null; }
if [[ -x $venv/bin/python && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  compile_package
  echo "setup: reusing $venv (requirements unchanged)"
  exit 0
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "ddpo_tpu needs Python >= 3.11"'
[[ -x $venv/bin/python ]] || "$PY" -m venv "$venv"
# uv installs the lockfile (measured on a 2-core machine without a download cache, 2026-11-29: 44 s against pip's
# 211 s for requirements.txt; the same versions). It is pinned in both lockfiles and bootstrapped with the venv's pip;
# where uv cannot reach an index pip can (pip.conf mirrors uv does not read), pip installs instead.
UV_VERSION="$(sed -n 's/^uv==//p' "$lock")"
"$venv/bin/python" -m pip install -q "uv==$UV_VERSION"
# uv writes no bytecode unless asked (pip does): without it every Python process compiles torch, diffusers and
# transformers from source again, ~19 CPU-s a training process on these machines, where PYTHONDONTWRITEBYTECODE=1
# keeps the result from being cached (measured 2026-11-29: `import torch, diffusers, transformers` 33 against 14 CPU-s)
install() {  # install ARGS... into the venv: uv, else pip
  "$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" "$@" && return 0
  echo "setup: uv could not install ($*); pip installs instead" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
  "$venv/bin/python" -m pip install -q "$@"
}
install -r "$lock"
# setuptools boxes a warning about editable installs (a folder named like the package in the working directory may
# shadow it: here it is the package itself); the message filter reaches the isolated build through the environment
PYTHONWARNINGS="ignore:Editable installation" install --no-deps -e .
compile_package
echo "$want" > "$stamp"
echo "setup: $venv ready"
