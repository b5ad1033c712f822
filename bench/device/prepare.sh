#!/usr/bin/env bash
# Prepares a GPU machine's run (bench/device/run.sh) here, where the package index is reachable:
# the GPU image (PyTorch, transformers, pytest, ...) lacks this project's other dependencies and
# can fetch nothing, so their Python 3.12 wheels go to .gpu/whl; the default model's config and
# tokenizer go to .gpu/skeleton (the GGUF is too big to travel: the GPU benches build random
# weights of its shape). .gpu is git-ignored; name it in the device run's `carry`.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu/whl
.venv/bin/python -m bench.torch_batching --write-skeleton .gpu/skeleton
# What the gpu tests and the GPU benches import beyond the image's packages, at the versions
# this project's environment has.
pins=$(.venv/bin/python - <<'PY'
import importlib.metadata as md
names = ["openai", "httpx2", "httpcore2", "truststore", "jiter", "pydantic", "pydantic-core", "annotated-types",
         "typing-inspection", "sniffio", "msgspec", "llguidance", "trio", "outcome", "pydot", "pytest-asyncio",
         "pytest", "typing_extensions", "pluggy", "iniconfig", "nats-py", "opentelemetry-api", "pydantic-settings",
         "python-dotenv", "python-json-logger", "redis", "starlette", "uvicorn"]
out = []
for n in names:
    try:
        out.append(f"{n}=={md.version(n)}")
    except md.PackageNotFoundError:
        pass
print(" ".join(out))
PY
)
platforms=""
for p in manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux2014; do
  platforms="$platforms --platform ${p}_x86_64"
done
# shellcheck disable=SC2086  # both lists split on purpose
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms \
  -d .gpu/whl $pins
du -sh .gpu
