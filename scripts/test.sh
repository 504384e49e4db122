#!/usr/bin/env bash
# Runs the whole test suite, the documentation site's strict build included (sets up .venv on first use). Extra arguments go to pytest, e.g. scripts/test.sh -k verify
set -euo pipefail
source "$(dirname "$0")/_env.sh"
.venv/bin/ruff check tierckpt tests benchmarks examples docs
.venv/bin/mypy  # strict type checks of format/ and storage/ (pyproject.toml [tool.mypy])
# the native host copy (tierckpt/host/_hostcopy.c) is optional for users, but here it must have been built
export TIERCKPT_EXPECT_NATIVE=1
# one pytest-xdist worker per core (TIERCKPT_TEST_WORKERS=N overrides, 0 runs in this process), a whole test file
# per worker, the slowest files first (tests/conftest.py); the ten slowest tests are listed at the end
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${TIERCKPT_TEST_WORKERS:-auto}" --dist loadfile \
  --no-loadscope-reorder --durations=10 "$@"
