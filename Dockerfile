# ddpack CPU image: the entrypoint and DDP trainer with the CPU build of torch (gloo).
# Build with BuildKit (`make image`); the CA bundle, if any, is a secret and never stored in a layer.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

# Given by make image: ddpack/images/images.py's DEFAULT_TORCH_VERSION (the one definition), or TORCH_VERSION.
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_EXTRA_ARGS=""
# 1 keeps what no runtime here loads: torch's C++ test programs and CMake files, the packages' test suites.
ARG KEEP_DEV_FILES=0
# 1: g++ (and Python's headers where the base lacks them) with torch's C++ headers, so that torch.compile
# works in the container; 0 leaves them out (a smaller image, see README) and torch.compile fails there.
ARG WITH_COMPILER=1

# The compiler first: a system layer that changes less often than torch.
RUN --mount=type=bind,source=docker/install-compiler.sh,target=/tmp/install-compiler.sh \
    if [ "${WITH_COMPILER}" = "1" ]; then sh /tmp/install-compiler.sh; fi

# Dependencies first: this layer is rebuilt only when torch's version or the base changes.
RUN --mount=type=secret,id=pip_cert,required=false \
    --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    --mount=type=bind,source=docker/install-runtime.sh,target=/tmp/install-runtime.sh \
    PIP_EXTRA_ARGS="${PIP_EXTRA_ARGS}" KEEP_DEV_FILES="${KEEP_DEV_FILES}" WITH_COMPILER="${WITH_COMPILER}" sh /tmp/install-runtime.sh "torch==${TORCH_VERSION}+cpu" "${TORCH_INDEX_URL}" cpu

COPY docker/profile.sh /etc/profile.d/ddpack.sh

# Set explicitly so host values that enroot/pyxis pass through cannot leak into the runtime.
ENV VIRTUAL_ENV=/opt/ddpack/venv \
    PATH=/opt/ddpack/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONPATH="" \
    LD_LIBRARY_PATH="" \
    PYTHONUNBUFFERED=1 \
    PYTHONNOUSERSITE=1 \
    DDPACK_VARIANT=cpu

# The bundle's code last: a trainer change rebuilds only this layer.
COPY entrypoint /opt/ddpack/lib/entrypoint
COPY train /opt/ddpack/lib/train
COPY ddpack_run /opt/ddpack/lib/ddpack_run
RUN python -m compileall -q /opt/ddpack/lib >/dev/null && chmod -R a+rX /opt/ddpack/lib && mkdir -p /workspace && chmod 1777 /workspace

ARG VERSION=dev
ARG REVISION=unknown
ARG SOURCE=https://github.com/ddpack/ddpack
# What `entrypoint --preflight` compares across ranks, and the mark of "inside the bundle's image".
RUN python -c 'import json, sys; json.dump(dict(version=sys.argv[1], revision=sys.argv[2], variant=sys.argv[3]), sys.stdout)' \
        "${VERSION}" "${REVISION}" cpu > /opt/ddpack/lib/ddpack-build.json && chmod 0644 /opt/ddpack/lib/ddpack-build.json
LABEL org.opencontainers.image.title="ddpack" \
      org.opencontainers.image.description="PyTorch DDP launcher and trainer (CPU, gloo)" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.ddpack.torch.version="${TORCH_VERSION}+cpu" \
      io.ddpack.compiler="${WITH_COMPILER}" \
      io.ddpack.variant="cpu"

WORKDIR /workspace
ENTRYPOINT ["/usr/local/bin/entrypoint"]
CMD []
