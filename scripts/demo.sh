#!/usr/bin/env bash
# The main job: a small transformer trains on CPU, checkpoints, is killed mid-run, restarts, restores and finishes,
# printing every save's stall and durable times (sets up .venv on first use).
set -euo pipefail
source "$(dirname "$0")/_env.sh"
exec .venv/bin/python examples/demo_train.py "$@"
