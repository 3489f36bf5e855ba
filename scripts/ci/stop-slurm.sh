#!/usr/bin/env bash
# Stops the daemons that scripts/ci/provision-slurm.sh started: exactly the PIDs it recorded (slurmd, slurmctld,
# and munged when it started one), each only while it is still the program recorded. Jobs still on the cluster are
# cancelled through SLURM first (their processes belong to slurmstepd, which outlives slurmd). The config and the
# state folder stay, so provisioning again brings the same cluster back.
#
# Usage:
#   scripts/ci/stop-slurm.sh
#
# Settings (environment):
#   SLURM_STATE_DIR  the state folder given to provision-slurm.sh (default /tmp/train-slurm)
#   STOP_WAIT_S      how long each daemon gets to exit after SIGTERM before SIGKILL (default 20)
set -Eeuo pipefail

SLURM_STATE_DIR=${SLURM_STATE_DIR:-/tmp/train-slurm}
STOP_WAIT_S=${STOP_WAIT_S:-20}

log() { printf 'stop-slurm: %s\n' "$*"; }

running() {  # running NAME PID: PID runs and is still NAME, not a later process that reused the number
    [ "$(cat "/proc/$2/comm" 2>/dev/null || true)" = "$1" ]
}

stop() {
    local name=$1 file=$SLURM_STATE_DIR/$1.pid pid
    pid=$(cat "$file" 2>/dev/null || true)
    if [ -z "$pid" ]; then
        log "$name: none recorded"
        return 0
    fi
    if ! running "$name" "$pid"; then
        log "$name: $pid already gone"
        rm -f "$file"
        return 0
    fi
    log "$name: stopping $pid"
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + STOP_WAIT_S))
    while running "$name" "$pid"; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "$name: $pid still running after ${STOP_WAIT_S} s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.5
            break
        fi
        sleep 0.2
    done
    rm -f "$file"
}

cancel_jobs() {
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null || true)
    [ -n "$jobs" ] || return 0
    log "cancelling jobs: ${jobs//$'\n'/ }"
    # shellcheck disable=SC2086  # one job id a word
    scancel $jobs || true
    local deadline=$((SECONDS + STOP_WAIT_S + 30))  # KillWait (30 s) before SLURM's SIGKILL
    while [ -n "$(squeue -h -o %A 2>/dev/null || true)" ]; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "jobs still listed after $((STOP_WAIT_S + 30)) s: $(squeue -h -o '%A %T' | tr '\n' ' ')"
            return 0
        fi
        sleep 0.5
    done
}

[ $# -eq 0 ] || { sed -n '2,/^set -Eeuo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 2; }
if [ -n "$(cat "$SLURM_STATE_DIR/slurmctld.pid" 2>/dev/null || true)" ]; then
    cancel_jobs
fi
# slurmd first: it ends its jobs while the controller still hears of it.
for name in slurmd slurmctld munged; do
    stop "$name"
done
