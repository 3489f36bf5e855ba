#!/usr/bin/env bash
# Makes this machine a one-node SLURM cluster for the slurm tests: slurmctld and slurmd from the distribution's
# packages (SLURM 22.05 on Debian 12), munge for authentication, one fake GPU, and settings that make requeued
# jobs start again within seconds. No init system is needed: the daemons are started in the background and their
# PIDs recorded, so that scripts/ci/stop-slurm.sh stops exactly them. Idempotent: a re-run with the daemons up and
# the same config only checks that the node is idle.
#
# Usage:
#   scripts/ci/provision-slurm.sh          install what is missing, write the config, start the daemons, wait
#
# Settings (environment):
#   SLURM_STATE_DIR  state folder: PIDs, logs, StateSaveLocation, SlurmdSpoolDir (default /tmp/train-slurm)
#   SLURM_CONF       the slurm.conf written and read by every SLURM command (default /etc/slurm/slurm.conf);
#                    one this script did not write is never overwritten
#   SLURM_CPUS       CPUs the node offers to jobs (default 16, more than the cores: short test jobs run side by side
#                    instead of queueing; nothing binds them to cores)
#   SLURM_WAIT_S     how long to wait for the node to become idle (default 60)
set -Eeuo pipefail

SLURM_STATE_DIR=${SLURM_STATE_DIR:-/tmp/train-slurm}
SLURM_CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
SLURM_CPUS=${SLURM_CPUS:-16}
SLURM_WAIT_S=${SLURM_WAIT_S:-60}
export SLURM_CONF

# The first line of every file this script writes: a slurm.conf without it belongs to someone else.
readonly marker="# Written by scripts/ci/provision-slurm.sh (one-node test cluster); re-run it to change this file."
readonly packages=(slurmctld slurmd slurm-client munge)

log() { printf 'provision-slurm: %4d s  %s\n' "$SECONDS" "$*"; }
die() { printf 'provision-slurm: error: %s\n' "$*" >&2; exit 1; }
# shellcheck disable=SC2016  # the backquotes are literal: they frame the failed command
trap 'printf "provision-slurm: error: \`%s\` exited with %s (line %s)\n" "$BASH_COMMAND" "$?" "$LINENO" >&2' ERR

recorded_pid() { cat "$SLURM_STATE_DIR/$1.pid" 2>/dev/null || true; }
# alive NAME: the recorded process runs, and is still NAME (a PID of a daemon that died may have been reused).
alive() {
    local pid
    pid=$(recorded_pid "$1")
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null || true)" = "$1" ]
}
# started NAME: the process this run started has not exited (for a moment it is still setsid or setpriv).
started() {
    local pid
    pid=$(recorded_pid "$1")
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

install_packages() {
    local missing=() p
    for p in "${packages[@]}"; do
        [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ] || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        log "packages: ${packages[*]} already installed"
        return 0
    fi
    command -v apt-get >/dev/null || die "apt-get not found; cannot install ${missing[*]} (a Debian-like machine is needed)"
    log "apt-get install ${missing[*]}"
    apt-get update -qq || die "apt-get update failed"
    # The packages try to start their services and fail without an init system; the daemons are started below.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
}

munge_answers() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_answers; then
        log "munge: already answering"
        return 0
    fi
    [ -s /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing; create it with: mungekey --create"
    install -d -o munge -g munge -m 0755 /run/munge
    # setpriv execs munged, so $! is the daemon itself; setsid detaches it from this script's session.
    setsid setpriv --reuid=munge --regid=munge --init-groups munged --foreground \
        >>"$SLURM_STATE_DIR/munged.log" 2>&1 </dev/null &
    echo $! >"$SLURM_STATE_DIR/munged.pid"
    local deadline=$((SECONDS + 15))
    until munge_answers; do
        started munged || { tail -n 20 "$SLURM_STATE_DIR/munged.log" >&2; die "munged exited"; }
        [ "$SECONDS" -lt "$deadline" ] || die "munged did not answer within 15 s (log: $SLURM_STATE_DIR/munged.log)"
        sleep 0.2
    done
    log "munge: munged $(recorded_pid munged) answering"
}

node_line() {  # the node as slurmd finds it (sockets, memory), with SLURM_CPUS CPUs and one fake GPU
    local hw sockets memory
    hw=$(slurmd -C | head -n 1) || die "slurmd -C failed"
    sockets=$(sed -n 's/.*SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$hw")
    memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
    if [ -z "$sockets" ] || [ -z "$memory" ]; then
        die "could not read the sockets and memory from \`slurmd -C\`: $hw"
    fi
    # With SlurmdParameters=config_overrides slurmd takes these numbers as given; one thread per core keeps the
    # CPUs equal to the cores, as SLURM's consistency checks expect.
    local per_socket=$(((SLURM_CPUS + sockets - 1) / sockets))
    echo "NodeName=$host CPUs=$((per_socket * sockets)) Sockets=$sockets CoresPerSocket=$per_socket" \
        "ThreadsPerCore=1 RealMemory=$memory Gres=gpu:1 State=UNKNOWN"
}

config_changed=0
write_config() {  # sets config_changed=1 when slurm.conf or gres.conf got new contents
    local conf_dir
    conf_dir=$(dirname "$SLURM_CONF")
    mkdir -p "$conf_dir" "$SLURM_STATE_DIR/state" "$SLURM_STATE_DIR/spool"
    if [ -e "$SLURM_CONF" ] && [ "$(head -n 1 "$SLURM_CONF")" != "$marker" ]; then
        die "$SLURM_CONF exists and was not written by this script; move it away or set SLURM_CONF to another path"
    fi
    local node conf gres
    node=$(node_line)
    conf="$marker
ClusterName=train-ci
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
# Requeued jobs wait cred_expire + 1 s before they may start again (120 s by default); 5 is the least allowed.
AuthInfo=cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The main scheduler runs on events and every sched_interval seconds (60 by default): a requeued job whose start
# delay has passed is only picked up by that periodic pass.
SchedulerParameters=sched_interval=2
# Take the node line as written: more CPUs than cores, so that short test jobs do not queue behind each other.
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
GresTypes=gpu
StateSaveLocation=$SLURM_STATE_DIR/state
SlurmdSpoolDir=$SLURM_STATE_DIR/spool
SlurmctldPidFile=$SLURM_STATE_DIR/slurmctld.pidfile
SlurmdPidFile=$SLURM_STATE_DIR/slurmd.pidfile
SlurmctldLogFile=$SLURM_STATE_DIR/slurmctld.log
SlurmdLogFile=$SLURM_STATE_DIR/slurmd.log
$node
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP"
    # A GPU that is not there: jobs asking for it get CUDA_VISIBLE_DEVICES=0 and SLURM_GPUS_ON_NODE=1.
    gres="$marker
NodeName=$host Name=gpu File=/dev/null"
    if [ "$(cat "$SLURM_CONF" 2>/dev/null || true)" != "$conf" ]; then
        printf '%s\n' "$conf" >"$SLURM_CONF.tmp" && mv "$SLURM_CONF.tmp" "$SLURM_CONF"
        config_changed=1
    fi
    local gres_conf=$conf_dir/gres.conf
    if [ -e "$gres_conf" ] && [ "$(head -n 1 "$gres_conf")" != "$marker" ]; then
        die "$gres_conf exists and was not written by this script; move it away"
    fi
    if [ "$(cat "$gres_conf" 2>/dev/null || true)" != "$gres" ]; then
        printf '%s\n' "$gres" >"$gres_conf.tmp" && mv "$gres_conf.tmp" "$gres_conf"
        config_changed=1
    fi
}

stop_daemon() {  # stop_daemon NAME: the recorded PID only, and wait for it to go
    if alive "$1"; then
        local pid
        pid=$(recorded_pid "$1")
        log "$1: stopping $pid (the config changed)"
        kill "$pid"
        local deadline=$((SECONDS + 20))
        while alive "$1"; do
            [ "$SECONDS" -lt "$deadline" ] || die "$1 ($pid) did not stop within 20 s"
            sleep 0.2
        done
    fi
    rm -f "$SLURM_STATE_DIR/$1.pid"
}

start_daemon() {  # start_daemon NAME: slurmctld or slurmd in the foreground mode (-D), detached, PID recorded
    local name=$1
    if alive "$name"; then
        log "$name: $(recorded_pid "$name") already running"
        return 0
    fi
    # -D: no fork, so $! is the daemon; setsid: it outlives this script and keeps none of its descriptors.
    setsid "$name" -D >>"$SLURM_STATE_DIR/$name.out" 2>&1 </dev/null &
    echo $! >"$SLURM_STATE_DIR/$name.pid"
    log "$name: started $! (log: $SLURM_STATE_DIR/$name.log)"
}

wait_idle() {
    local deadline=$((SECONDS + SLURM_WAIT_S)) state="" resumed=0
    while :; do
        state=$(sinfo -h -n "$host" -o '%T' 2>/dev/null || true)
        case $state in
            idle | mixed | allocated) break ;;
            # Left down or drained by an earlier run (e.g. a job that could not be killed): take it back once.
            down | drained | draining | drain)
                if [ "$resumed" = 0 ]; then
                    log "node $host is $state ($(sinfo -h -n "$host" -o '%E')): resuming it"
                    scontrol update NodeName="$host" State=RESUME || true
                    resumed=1
                fi
                ;;
        esac
        local name
        for name in slurmctld slurmd; do
            started "$name" || {
                tail -n 20 "$SLURM_STATE_DIR/$name.log" "$SLURM_STATE_DIR/$name.out" >&2 2>/dev/null || true
                die "$name exited (last lines of its log above)"
            }
        done
        if [ "$SECONDS" -ge "$deadline" ]; then
            tail -n 20 "$SLURM_STATE_DIR/slurmctld.log" "$SLURM_STATE_DIR/slurmd.log" >&2 2>/dev/null || true
            die "node $host not idle within ${SLURM_WAIT_S} s (sinfo says: '${state:-no answer}'; logs above)"
        fi
        sleep 0.5
    done
    log "node $host is $state: $(sinfo -h -n "$host" -o '%c CPUs, %m MB, gres %G, partition %P')"
}

main() {
    [ $# -eq 0 ] || { sed -n '2,/^set -Eeuo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 2; }
    [ "$(id -u)" -eq 0 ] || die "must run as root (apt-get, munge and the SLURM daemons need it)"
    install_packages
    host=$(hostname -s)
    getent hosts "$host" >/dev/null || die "the host name $host does not resolve; add it to /etc/hosts"
    mkdir -p "$SLURM_STATE_DIR"
    start_munge
    write_config
    if [ "$config_changed" = 1 ]; then
        log "config: wrote $SLURM_CONF and gres.conf"
        stop_daemon slurmd
        stop_daemon slurmctld
    else
        log "config: $SLURM_CONF unchanged"
    fi
    start_daemon slurmctld
    start_daemon slurmd
    wait_idle
}

main "$@"
