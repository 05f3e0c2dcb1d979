# paperline worker image with CUDA: the repo at /opt/paperline, installed with a CUDA build of
# torch. Build from the repo root:
#   docker build -f infra/worker.Dockerfile -t paperline-worker:latest .
# The CUDA runtime comes with the torch wheel (nvidia-* packages); the host provides the driver
# through the NVIDIA container toolkit. Pick the wheel's CUDA with TORCH_INDEX (cu126, cu128, ...).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PREFECT_HOME=/opt/paperline/.paperline/prefect \
    HF_HOME=/opt/paperline/.paperline/hf \
    DVC_SITE_CACHE_DIR=/opt/paperline/.paperline/dvc-site \
    MLFLOW_DISABLE_TELEMETRY=true \
    PAPERLINE_ROOT=/opt/paperline

RUN apt-get update \
    && apt-get install -y --no-install-recommends git ca-certificates procps \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CUDA index, at the version pyproject.toml pins (the project install below
# then finds it satisfied instead of pulling the CPU build)
RUN pip install --index-url ${TORCH_INDEX} torch==${TORCH_VERSION}

WORKDIR /opt/paperline
COPY . /opt/paperline
RUN pip install -e . \
    && git config --global --add safe.directory /opt/paperline \
    && (git rev-parse --git-dir >/dev/null 2>&1 || git init -q)

# No credentials here: S3 and database secrets arrive as environment variables at run time.
CMD ["infra/gpu-workers.sh", "run"]
