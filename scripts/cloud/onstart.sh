#!/usr/bin/env bash
# Start script of a rented GPU box (vast.ai, RunPod and the like replace the image's entrypoint with their own
# command): run the training, keep its log, and end with the training's own exit status, so that a failed run
# is never reported as a finished one.
#
# Settings (environment):
#   TRAIN_DIR      project directory (default: the repository this script is in)
#   PYTHON         interpreter (default: the project's .venv/bin/python when it exists, else python3)
#   TRAIN_COMMAND  python -m train command (default: run)
#   CONFIG         config file (default: configs/default.yaml)
#   TRAIN_ARGS     further arguments, split on whitespace, e.g. "--set train.epochs=20 --run big"
#   TRAIN_LOG      log file, appended to (default: runs/onstart.log)
#   ON_EXIT        shell command run after the training, e.g. one that stops the instance; it sees
#                  TRAIN_EXIT_CODE and cannot change the exit status
#
# No `set -e`: a failing training must reach the report below, not end the script before it.
set -uo pipefail

cd "${TRAIN_DIR:-$(dirname "${BASH_SOURCE[0]}")/../..}" || { echo "onstart: cannot enter the project directory" >&2; exit 1; }

log=${TRAIN_LOG:-runs/onstart.log}
mkdir -p "$(dirname "$log")" || { echo "onstart: cannot create the folder of $log" >&2; exit 1; }

python=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}

# read -a splits without expanding globs, so "--set x=*" stays as written
read -r -a train_args <<< "${TRAIN_ARGS:-}"

"$python" -m train "${TRAIN_COMMAND:-run}" --config "${CONFIG:-configs/default.yaml}" \
    ${train_args[@]+"${train_args[@]}"} 2>&1 | tee -a "$log"
# the training's status, not tee's
code=${PIPESTATUS[0]}

if [[ $code -eq 0 ]]; then
    result="onstart: training succeeded"
else
    result="onstart: training failed with exit code $code (see $log)"
fi
# before ON_EXIT: a hook that stops the box must not cut off the verdict
echo "$result" | tee -a "$log"

if [[ -n ${ON_EXIT:-} ]]; then
    TRAIN_EXIT_CODE=$code bash -c "$ON_EXIT" || echo "onstart: ON_EXIT failed with exit code $?" >&2
fi
exit "$code"
