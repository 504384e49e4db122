# Shared set-up for scripts/demo.sh and scripts/test.sh: a virtual environment in .venv with torch and tierckpt.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# whether a module is installed, without importing it (importing Lightning and transformers costs ~9 s of CPU)
installed() { "$VPY" -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' "$@" >/dev/null 2>&1; }
if ! installed torch; then
  # 2.13.0 is the CPU wheel available on our machines; tierckpt itself accepts torch >= 2.4.
  # setuptools as new as [build-system] requires, so that the packaging test builds offline
  "$VPY" -m pip install -q --upgrade pip "setuptools>=77" >/dev/null
  "$VPY" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
if ! installed tierckpt pytest xdist sybil moto s3fs hypothesis lightning transformers mypy prometheus_client mkdocs \
      material mkdocstrings_handlers.python \
    || [ pyproject.toml -nt .venv/.tierckpt-installed ] || [ setup.py -nt .venv/.tierckpt-installed ] \
    || [ tierckpt/host/_hostcopy.c -nt .venv/.tierckpt-installed ]; then
  "$VPY" -m pip install -q -e ".[test,bench]"
  touch .venv/.tierckpt-installed
fi
