# syntax=docker/dockerfile:1
# The data-plane images, one build with a target per role (they differ only in what they
# EXPOSE and run; everything else - the wheel, the user, the environment - is shared):
#   docker build --target stage    -t ghcr.io/inferencemesh/stage:0.1.0 .     # one layer range behind gRPC
#   docker build --target frontend -t ghcr.io/inferencemesh/frontend:0.1.0 .  # OpenAI API, speculative decoding
# (the operator has its own, torch-free image: operator/Dockerfile).
#
# BASE_IMAGE: the default is a CUDA PyTorch runtime. Any base with Python >= 3.10 and pip works;
# a base that already has torch, the project's dependencies and setuptools >= 77 makes the build
# need no package index at all (tools/cluster/base_image.sh makes one from Debian packages and
# local wheels: what a cluster without registry access uses, e.g.
#   buildah bud --isolation chroot --build-arg BASE_IMAGE=localhost/inferencemesh/base:<hash> --target stage .)
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
COPY stage_image/stage/ stage_image/stage/
COPY frontend_image/frontend/ frontend_image/frontend/
COPY operator/controller/ operator/controller/
# --no-build-isolation builds with the base's setuptools (installed here only where the base has
# none new enough) instead of fetching a throw-away build environment from an index.
RUN pip install "setuptools>=77" wheel \
 && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels /src

FROM ${BASE_IMAGE} AS runtime
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
# Only the project's wheel travels; its dependencies resolve against the base (torch is already
# there; on a prepared base every dependency is, and pip contacts no index).
RUN pip install /wheels/inferencemesh-*.whl && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp inferencemesh
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/cache/hf
USER 10001:10001
ENTRYPOINT ["inferencemesh"]

FROM runtime AS stage
EXPOSE 50051 9090
CMD ["stage", "--help"]

FROM runtime AS frontend
EXPOSE 8000
CMD ["frontend", "--help"]
