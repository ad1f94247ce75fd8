#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned requirements and ddpo_tpu installed in editable mode.
# Reuses an existing .venv when requirements.txt and pyproject.toml have not changed (there is no download cache on
# CI machines: a fresh install of torch + torch_xla takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
stamp=".venv/.ddpo_tpu-requirements.sha256"
want="$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [[ -x .venv/bin/python && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "setup: reusing .venv (requirements unchanged)"
  exit 0
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "ddpo_tpu needs Python >= 3.11"'
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
echo "$want" > "$stamp"
echo "setup: .venv ready"
