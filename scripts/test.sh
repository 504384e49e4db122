#!/usr/bin/env bash
# Runs the whole test suite, the documentation site's strict build included (sets up .venv on first use). Extra arguments go to pytest, e.g. scripts/test.sh -k verify
set -euo pipefail
source "$(dirname "$0")/_env.sh"
.venv/bin/ruff check tierckpt tests benchmarks examples docs
.venv/bin/mypy  # strict type checks of format/ and storage/ (pyproject.toml [tool.mypy])
# the native host copy (tierckpt/host/_hostcopy.c) is optional for users, but here it must have been built
export TIERCKPT_EXPECT_NATIVE=1
# bytecode caches (git-ignored) spare each worker and each test subprocess recompiling the tests and tierckpt
unset PYTHONDONTWRITEBYTECODE
# pytest-xdist workers, two a core up to 16 (the tests wait on subprocesses, sockets and timers a good part of the
# time: on 2 cores, 4 workers keep both busy where 3 left a fifth of their time idle, and 5 only add contention;
# TIERCKPT_TEST_WORKERS=N overrides, 0 runs in this process), a whole test file per worker, the slowest files first
# (tests/conftest.py); the ten slowest tests are listed at the end
cores=$(nproc 2>/dev/null || echo 2)
workers=$(( cores * 2 < 16 ? cores * 2 : 16 ))
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${TIERCKPT_TEST_WORKERS:-$workers}" \
  --dist loadfile --no-loadscope-reorder --durations=10 "$@"
