#!/usr/bin/env bash
# The project's test command: set up everything a fresh machine needs, check style, types
# and import contracts (pyproject.toml [tool.importlinter]), then run every test (unit and
# integration against the real local Kafka + Redis, which the test session starts; the
# container tests start an engine and build the images first, deploy/containers/engine.sh).
# Extra arguments go to pytest.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash deploy/setup.sh

echo "test: ruff"
.venv/bin/ruff check proxy dedup deploy tests benchmarks
.venv/bin/ruff format --check proxy dedup deploy tests benchmarks
echo "test: mypy"
.venv/bin/mypy
echo "test: import contracts"
.venv/bin/lint-imports --no-logo
echo "test: pytest"
status=0
# The slowest tests are listed at the end: the run must stay well inside CI's 90 minutes.
.venv/bin/pytest --durations=25 "$@" || status=$?
if [ -n "${CI:-}" ]; then
    # A CI machine keeps nothing running after the run: nor the engine engine.sh started.
    .venv/bin/dedup-proxy local down || true
    bash deploy/containers/engine.sh stop || true
fi
exit "$status"
