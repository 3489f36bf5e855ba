# The training image. PyTorch, CUDA and NCCL come from the base image and are never reinstalled: pick the base
# whose CUDA your driver supports (docs/launching.md, "Containers"). Without registry access, build FROM any image with
# Python >= 3.10 and torch, and put the other wheels in wheels/ (the offline path, used by CI).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime
FROM ${BASE_IMAGE}
# Optional extras of the package to bake in, comma-separated: e.g. EXTRAS=wandb for obs.wandb tracking.
ARG EXTRAS=""

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# make: the Makefile's targets work inside as outside. A C/C++ compiler and Python's headers: torch.compile needs
# them (Triton builds its CUDA launcher with gcc, inductor's CPU kernels are C++ including Python.h); the
# -runtime images lack the compiler, a distribution's Python lacks the headers.
# hadolint ignore=DL3008
RUN packages=(); \
    command -v make >/dev/null || packages+=(make); \
    command -v g++ >/dev/null || packages+=(g++); \
    python -c "import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
        || packages+=(python3-dev); \
    if [ ${#packages[@]} -gt 0 ]; then \
        apt-get update && apt-get install -y --no-install-recommends "${packages[@]}" && rm -rf /var/lib/apt/lists/*; \
    fi

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MPLBACKEND=Agg \
    MPLCONFIGDIR=/tmp/matplotlib \
    HOME=/home/train \
    USER=train

WORKDIR /app

# Dependencies first, in their own layer: changing the source does not reinstall them. The venv sees the base
# image's packages (a .pth file naming the base's site-packages: --system-site-packages alone misses them when
# the base's python is itself a venv), and a constraint pins torch to exactly the base's build, so pip can never
# replace it. With wheels in wheels/, nothing is fetched from an index. (The test for them is no `find | grep -q`:
# under pipefail, find killed by SIGPIPE once grep has its line fails the test when the list outgrows one write.)
COPY pyproject.toml ./
COPY wheels/ /tmp/wheels/
RUN python -c "import sysconfig as s; print('\n'.join(dict.fromkeys(s.get_paths()[k] for k in ('purelib', 'platlib'))))" \
        > /tmp/base-image.pth \
    && python -m venv --system-site-packages .venv \
    && mv /tmp/base-image.pth "$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/" \
    && .venv/bin/python -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
    && EXTRAS="$EXTRAS" .venv/bin/python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + [r for e in filter(None, os.environ['EXTRAS'].split(',')) for r in p['optional-dependencies'][e.strip()]]))" > /tmp/requirements.txt \
    && echo "setuptools>=68" >> /tmp/requirements.txt \
    && if [ -n "$(find /tmp/wheels -name '*.whl' -print -quit)" ]; then printf -- '--no-index\n--find-links /tmp/wheels\n' >> /tmp/requirements.txt; fi \
    && .venv/bin/python -m pip install -c /tmp/torch-constraint.txt -r /tmp/requirements.txt \
    && rm -rf /tmp/wheels /tmp/requirements.txt

ENV VIRTUAL_ENV=/app/.venv \
    PATH=/app/.venv/bin:$PATH

COPY Makefile constraints.txt README.md ./
COPY configs/ configs/
COPY scripts/ scripts/
COPY train/ train/
# The Makefile's install stamp: `make smoke-test` and friends use this venv as it is.
RUN .venv/bin/python -m pip install --no-deps --no-build-isolation --no-index -e . \
    && .venv/bin/python -c "import torch, train; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    && touch .venv/.installed \
    && mkdir -p /data /cache /runs /home/train \
    && chown 1000:1000 /data /cache /runs /home/train \
    && ln -s /data data && ln -s /cache cache && ln -s /runs runs

# A numeric user: it needs no /etc/passwd entry, and host folders mounted for it belong to uid 1000.
USER 1000:1000
VOLUME ["/data", "/cache", "/runs"]

# What `make train` runs, without make in between: make can only exit 2, and the container must exit with the
# training's own code (75: preempted, re-run to resume; 4: preflight; ...). exec: python is the process the
# init forwards SIGTERM to, so the ranks can checkpoint before the container stops.
ENV CONFIG=configs/default.yaml NPROC=auto TRAIN_ARGS=""
CMD ["sh", "-c", "exec python -m train run --config \"$CONFIG\" --nproc \"$NPROC\" $TRAIN_ARGS"]
