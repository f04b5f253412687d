#!/usr/bin/env bash
# Fill .whl/ with what the GPU machine's python lacks (../shared/device/README.md lists what it
# has), each at constraints.txt's pin where it has one, through ../shared/device/wheels.sh;
# benchmarks/gpu_env.sh installs them there. A fresh checkout has no .whl/ (it is ignored), so
# run this once before the first GPU call, and carry ".whl" with every call:
#   bash benchmarks/gpu_wheels.sh
# The list is the closure of the server's, the bench's, the tuner's and the tests' needs
# (fastapi, uvicorn, pyzmq, msgspec, orjson, optuna, openai, anthropic, compressed-tensors,
# pytest-xdist, and schemathesis / jsonschema-rs, so that `pytest -m gpu tests` collects every
# file there)
# minus the GPU machine's own packages and platform-only requirements (Windows, PyPy, < 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
NEEDED="alembic annotated-doc annotated-types anthropic colorlog compressed-tensors distro
docstring-parser execnet fastapi
graphql-core greenlet harfile httpcore2 httpx2 hypothesis hypothesis-graphql jiter jsonschema-rs loguru mako
msgspec openai opentelemetry-api optuna orjson pydantic pydantic-core pyrate-limiter
pytest-xdist pyzmq schemathesis sniffio sqlalchemy starlette truststore typing-extensions
typing-inspection uvicorn werkzeug"
specs=()
for name in $NEEDED; do
  # constraints.txt's pin, matched with -, _ and . as one and case ignored (PEP 503)
  pattern=$(echo "$name" | sed 's/[-_.]/[-_.]/g')
  pin=$(grep -iE "^${pattern}==" constraints.txt | head -1 || true)
  specs+=("${pin:-$name}")
done
../shared/device/wheels.sh "${specs[@]}"
# llguidance's only Linux wheel is manylinux_2_31, a platform the shared script does not ask for
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 -d .whl "$(grep -i '^llguidance==' constraints.txt)"
