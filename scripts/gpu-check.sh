#!/usr/bin/env bash
# make gpu-check: the GPU checks (train/bench/gpu/) in one command on a bare GPU machine.
#
# Python: the project's .venv when it exists; otherwise, where the machine's python3 already has a CUDA build of
# PyTorch (GPU images ship one matched to their driver), a venv on top of it (--system-site-packages) with this
# package installed into it (and neuraloperator, the perf check's peer); otherwise `make install` (whose dev
# extra has it). WHEELS=folder installs from wheels in that folder alone, for machines with no package index.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
GPU_VENV=${GPU_VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}

if [ -x "$VENV/bin/python" ]; then
  py=$VENV/bin/python
elif "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  if [ ! -x "$GPU_VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$GPU_VENV"
    # That python may itself be a venv's, whose packages --system-site-packages does not reach: a .pth does.
    "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
      >"$("$GPU_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/gpu-host.pth"
  fi
  offline=()
  if [ -n "${WHEELS:-}" ]; then offline=(--no-index --find-links "$WHEELS"); fi
  # The system's torch satisfies the requirement, so pip keeps it; --no-build-isolation uses its setuptools.
  "$GPU_VENV/bin/python" -m pip install --quiet --no-build-isolation "${offline[@]}" -e . \
    || { echo "gpu-check: installing the package into $GPU_VENV failed (see above)" >&2; exit 1; }
  py=$GPU_VENV/bin/python
  # The perf check's peer (neuraloperator's own Trainer); without it that one figure says why it is missing.
  "$py" -c 'import neuralop' 2>/dev/null \
    || "$py" -m pip install --quiet "${offline[@]}" "neuraloperator==2.0.0" \
    || echo "gpu-check: neuraloperator 2.0.0 could not be installed; the perf check's peer figure is left out" >&2
else
  make install
  py=$VENV/bin/python
fi
exec "$py" -m train.bench.gpu "$@"
