# A user's project on top of a ddpack image: `make image APP=DIR` (ddpack/images/images.py stages the context).
# Two layers over the bundle: the project's requirements, with the image's torch held fixed, then its code
# at /opt/app. A code change rebuilds only the last; a requirements change only the two.
ARG BUNDLE_IMAGE=ddpack:dev
FROM ${BUNDLE_IMAGE}

# pip options for the requirements alone (--no-index for an offline build: every wheel from the wheelhouse).
ARG APP_PIP_ARGS=""
# What the requirements may not change (ddpack.app.HELD_PACKAGES).
ARG APP_HELD="torch"
RUN --mount=type=secret,id=pip_cert,required=false \
    --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    --mount=type=bind,source=app-deps,target=/tmp/app-deps \
    --mount=type=bind,source=docker/install-app.py,target=/tmp/install-app.py \
    set -f && PIP_EXTRA_ARGS="${APP_PIP_ARGS}" python /tmp/install-app.py /tmp/app-deps/requirements.txt ${APP_HELD}

ENV DDPACK_APP_DIR=/opt/app
# Staged readable by any uid (pyxis runs tasks as the submitting user); no chmod here, which would copy
# every file into another layer.
COPY app /opt/app
ARG APP_RECORD="{}"
RUN --mount=type=bind,source=docker/install-app.py,target=/tmp/install-app.py \
    python /tmp/install-app.py --record "${APP_RECORD}"

ARG APP_NAME=app
ARG APP_REVISION=none
ARG APP_DIGEST=unknown
ARG APP_CMD=""
# entrypoint with no command runs DDPACK_APP_CMD (empty: the bundled trainer), in any working directory.
ENV DDPACK_APP_CMD="${APP_CMD}"
LABEL io.ddpack.app.name="${APP_NAME}" \
      io.ddpack.app.revision="${APP_REVISION}" \
      io.ddpack.app.digest="${APP_DIGEST}" \
      io.ddpack.app.command="${APP_CMD}"
WORKDIR /opt/app
