# syntax=docker/dockerfile:1
# Every InferenceMesh image, one build with a target per role. The wheel is built once (stage
# `wheel`) and installed by each:
#   docker build --target stage    -t ghcr.io/inferencemesh/stage:0.1.0 .     # stage_image/README.md
#   docker build --target frontend -t ghcr.io/inferencemesh/frontend:0.1.0 .  # frontend_image/README.md
#   docker build --target operator -t ghcr.io/inferencemesh/operator:0.1.0 .  # operator/README.md
#
# BASE_IMAGE (stage, frontend): the default is a CUDA PyTorch runtime. Any base with Python >= 3.10
# and pip works; a base that already has torch, the project's dependencies and setuptools >= 77
# makes the build need no package index at all (tools/cluster/base_image.sh makes one from Debian
# packages and local wheels: what a cluster without registry access uses, e.g.
#   buildah bud --isolation chroot --build-arg BASE_IMAGE=localhost/inferencemesh/base:<hash> \
#     --build-arg OPERATOR_BASE_IMAGE=... --build-arg WHEEL_BASE_IMAGE=... --target stage .)
# OPERATOR_BASE_IMAGE: the operator needs no torch; the project is installed without its
# dependencies and only the operator's own pins (OPERATOR_REQUIREMENTS) are added.
# WHEEL_BASE_IMAGE: where the (pure-Python) wheel is built; any Python with pip.
# NATIVE_BASE_IMAGE: where the native CPU kernels (quantized weights' decode and load) are compiled
# ahead of time, since the runtime images have no C compiler; any image with gcc and Python 3.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
ARG OPERATOR_BASE_IMAGE=python:3.11.11-slim-bookworm
ARG WHEEL_BASE_IMAGE=python:3.11.11-slim-bookworm
ARG NATIVE_BASE_IMAGE=python:3.11.11-bookworm
ARG OPERATOR_REQUIREMENTS="kopf==1.45.2 kubernetes==37.0.2 prometheus-client==0.26.0 PyYAML==6.0.3 pydantic==2.14.3 huggingface_hub==2.4.0 grpcio==1.85.1 grpcio-health-checking==1.85.1 cryptography==48.0.0"

FROM ${WHEEL_BASE_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
# --no-build-isolation builds with the base's setuptools (installed here only where the base has
# none new enough) instead of fetching a throw-away build environment from an index.
RUN pip install "setuptools>=77" wheel \
 && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels /src

# modeling/native_build.py: the library under the name the runtime looks for in
# INFERENCEMESH_NATIVE_PREBUILT (a hash of these sources: a stale one is never loaded).
FROM ${NATIVE_BASE_IMAGE} AS native
COPY src/inferencemesh/modeling/native_build.py /build/
COPY src/inferencemesh/modeling/native/ /build/native/
RUN python3 /build/native_build.py --prebuild /native

FROM ${BASE_IMAGE} AS runtime
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=native /native /opt/inferencemesh/native
COPY --from=wheel /wheels /wheels
# Only the project's wheel travels; its dependencies resolve against the base (torch is already
# there; on a prepared base every dependency is, and pip contacts no index).
RUN pip install /wheels/inferencemesh-*.whl && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp inferencemesh
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/cache/hf \
    INFERENCEMESH_NATIVE_PREBUILT=/opt/inferencemesh/native
USER 10001:10001
ENTRYPOINT ["inferencemesh"]

FROM runtime AS stage
EXPOSE 50051 9090
CMD ["stage", "--help"]

FROM runtime AS frontend
EXPOSE 8000
CMD ["frontend", "--help"]

FROM ${OPERATOR_BASE_IMAGE} AS operator
ARG OPERATOR_REQUIREMENTS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
RUN pip install ${OPERATOR_REQUIREMENTS} \
 && pip install --no-deps /wheels/inferencemesh-*.whl && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp inferencemesh
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8080 9090
ENTRYPOINT ["inferencemesh"]
CMD ["operator", "--standalone"]
