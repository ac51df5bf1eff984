# The same patched vLLM image that `build.py build` produces daemonlessly, for teams that build
# with BuildKit or podman. It is not used on its own: it builds a context written by
#
#   python build.py context --image NAME --pin PIN --sm SM --out DIR    (copies this file into DIR)
#   podman build $(sed 's/^/--build-arg=/' DIR/build-args) -t IMAGE DIR
#
# DIR holds everything kiln decided (see docs/BUILDING.md, "Building with a Dockerfile"):
#   rootfs/      kiln's files at their image paths: patched modules, /opt/kiln/manifest.json,
#                the Triton kernel cache of an image that has one
#   remove.txt   base files to delete: the stale bytecode of each patched module
#   base.txt     the base image the patches were computed against, by digest
#   build-args   BASE, KILN_PLATFORM, KILN_ENV and the values below, one KEY=VALUE per line

# The base, pinned by digest (registry/repository@sha256:...). No default on purpose: a tag
# could move, and the context's files were computed against one exact base.
ARG BASE
# Which environment the image gets, as the name of one of the stages below. build-args always
# names it: podman 4.3 does not resolve this default when it picks a stage.
ARG KILN_ENV=none

# The platform of the base the context was computed on (`context --platform`, default the
# host's); build-args always names it. BASE is the base's index: naming the platform picks the
# same manifest of it as the daemonless build, whatever machine runs this (an arm64 context
# built on an amd64 host runs its RUN step under emulation: qemu-user-static).
ARG KILN_PLATFORM=linux/amd64

FROM --platform=${KILN_PLATFORM} ${BASE} AS kiln-env-none

# An image with a Triton kernel cache layer also sets TRITON_CACHE_DIR, as the daemonless
# image's config does. ENV cannot be made conditional, so the choice is a stage; an image
# without the cache must not get the variable at all (an empty one is not "unset" to Triton).
FROM kiln-env-none AS kiln-env-triton
ARG KILN_TRITON_CACHE_DIR
ENV TRITON_CACHE_DIR=${KILN_TRITON_CACHE_DIR}

FROM kiln-env-${KILN_ENV}

# Re-declared after FROM so the steps below can read it.
ARG BASE

# Values of the image's labels (the daemonless build sets the same ones); build-args holds them.
ARG KILN_BASE_NAME
ARG KILN_BASE_DIGEST
ARG KILN_VERSION
ARG KILN_REVISION
ARG KILN_SOURCE
ARG KILN_IMAGE
ARG KILN_PIN
ARG KILN_SM
ARG KILN_PATCHES
ARG KILN_VLLM

# 1. Refuse a base other than the one in base.txt: a BASE without a digest, or another image,
#    would get kiln's files and labels although its vLLM source was never checked.
# 2. Delete the base's bytecode of every module kiln patches. The daemonless layer hides these
#    with whiteouts; without this, Python could keep importing the stale .pyc of a module.
#    This runs before the COPY, as a whiteout hides only lower layers, never kiln's own files.
# The two context files are bind-mounted for this step only, so they never enter the image.
RUN --mount=type=bind,source=base.txt,target=/run/kiln-base.txt \
    --mount=type=bind,source=remove.txt,target=/run/kiln-remove.txt \
    expected="$(cat /run/kiln-base.txt)" && \
    case "${BASE}" in \
      *@"${expected##*@}") ;; \
      *) echo "BASE=${BASE:-<unset>} is not ${expected}: build this context with --build-arg BASE=${expected}" >&2; exit 1 ;; \
    esac && \
    xargs -r rm -rf -- < /run/kiln-remove.txt

# kiln's files over the base: the patched modules, the audit file and, for an image with
# kernels, the Triton cache. Their mtime is the fixed one of the daemonless layers, which
# COPY keeps.
COPY rootfs/ /

# The labels of the daemonless image. A label kiln does not know (no git commit, no origin
# remote) is set to an empty value here, where the daemonless image leaves it out.
LABEL org.opencontainers.image.base.name="${KILN_BASE_NAME}" \
      org.opencontainers.image.base.digest="${KILN_BASE_DIGEST}" \
      org.opencontainers.image.version="${KILN_VERSION}" \
      org.opencontainers.image.revision="${KILN_REVISION}" \
      org.opencontainers.image.source="${KILN_SOURCE}" \
      io.kiln.image="${KILN_IMAGE}" \
      io.kiln.pin="${KILN_PIN}" \
      io.kiln.sm="${KILN_SM}" \
      io.kiln.patches="${KILN_PATCHES}" \
      io.kiln.vllm="${KILN_VLLM}"
