# Local CPU stand-in for pytorch/pytorch:<version>-runtime, built by scripts/ci/provision-docker.sh where no
# container registry can be reached. Like that image it puts one Python with torch first on PATH (there conda's,
# here a venv at /opt/venv), runs as root and starts in /workspace.
#
# Build context (prepared by the script): wheels/ holding the torch wheel, numpy (the pytorch images have it) and
# their dependencies, so that the build needs no network (pip inside containers cannot verify the registry's TLS
# on the CI machines).
# ROOTFS_IMAGE is a `docker import` of a debootstrap'd bookworm (minbase) that already contains python3 (3.11),
# python3-venv, ca-certificates and make: they come from debootstrap --include, not from apt in a RUN step, so
# the build works on machines whose containers cannot reach Debian's mirrors.
# Written for the classic builder too (no RUN --mount): buildx is not part of Debian's docker.io.

ARG ROOTFS_IMAGE=train-base-rootfs:bookworm
FROM ${ROOTFS_IMAGE}
ARG TORCH_VERSION=2.13.0

# Keeps services from starting when a derived image installs packages with apt (as Debian's official images do).
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d

# One stage on purpose: the ~200 MB of wheels stay hidden in a lower layer, which costs less than copying the
# ~700 MB venv out of a second stage (about 30 s on a 2-core CI machine).
COPY wheels/ /tmp/wheels/
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels \
        --disable-pip-version-check "torch==${TORCH_VERSION}" numpy \
 && rm -rf /tmp/wheels \
 && /opt/venv/bin/python -c "import torch; print('torch', torch.__version__, torch.ones(2).numpy())"

ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8 \
    PYTORCH_VERSION=${TORCH_VERSION}
LABEL org.opencontainers.image.title="train-base" \
      org.opencontainers.image.description="Debian bookworm, Python 3.11 venv at /opt/venv with the CPU build of torch ${TORCH_VERSION} and numpy"
WORKDIR /workspace
CMD ["/bin/bash"]
