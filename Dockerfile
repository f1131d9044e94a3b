# syntax=docker/dockerfile:1
# The ckptd daemon, one per node:  docker build -t ckptd .
#
# The daemon runs as uid/gid 10001: the host directories it gets must be writable by it
# (sudo install -d -o 10001 -g 10001 /var/lib/ckptd /run/ckptd). The trainers must see its shared
# memory and socket, and be in its group (arenas and the socket are mode 0660):
#   docker run -d --name ckptd --ipc=shareable --shm-size=32g \
#       -v /var/lib/ckptd:/var/lib/ckptd -v /run/ckptd:/run/ckptd ckptd
#   docker run --ipc=container:ckptd --group-add 10001 -v /run/ckptd:/run/ckptd \
#       -e CKPTD_ADDRESS=unix:///run/ckptd/ckptd.sock <trainer image> ...
# --shm-size must hold max_inflight snapshots of every local rank; Docker's default 64 MiB does not.
# Kubernetes: deploy/kubernetes/ (a DaemonSet with hostIPC; README: Deployment / Kubernetes).

# Pinned tag; for reproducible builds pin its digest too (python:3.11.14-slim-bookworm@sha256:...).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler for ckptd's C extensions (the quantization encoder and the streaming copy,
# setup.py); only in this stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY client ./client
COPY daemon ./daemon
# Only the ckptd wheel; its dependencies are installed in the final stage.
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# torch before ckptd, so that `pip install` of ckptd finds `torch>=2.4` satisfied and pulls no other build.
# CPU build by default (about 200 MB instead of several GB of CUDA libraries): in the copy and overlap
# modes the trainers do the device-to-host copies and the daemon only handles host memory. The ipc mode,
# where the daemon opens the trainers' CUDA buffers itself, needs a CUDA build matching the trainers':
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ -t ckptd:cuda .
# with cuXYZ the CUDA variant of the trainers' torch (torch.version.cuda).
# (ckptd falls back from ipc to overlap, saying why, when the daemon cannot open CUDA memory.)
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY --from=build /wheels /tmp/wheels
RUN pip install /tmp/wheels/ckptd-*.whl && rm -rf /tmp/wheels

RUN groupadd --system --gid 10001 ckptd \
 && useradd --system --uid 10001 --gid ckptd --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin ckptd \
 && install -d -o ckptd -g ckptd -m 0750 /var/lib/ckptd \
 && install -d -o ckptd -g ckptd -m 0750 /run/ckptd
# Numeric, so Kubernetes' runAsNonRoot can check it without the image's /etc/passwd.
USER 10001:10001

# Checkpoints (node-local disk or a shared file system) and the socket directory shared with the trainers.
VOLUME ["/var/lib/ckptd", "/run/ckptd"]
# Peer service (several nodes), Prometheus metrics (--metrics-port), gRPC health for probes (--health-port).
EXPOSE 7070 9477 9478

ENTRYPOINT ["ckptd"]
CMD ["serve", "--root", "/var/lib/ckptd", "--socket", "/run/ckptd/ckptd.sock"]
