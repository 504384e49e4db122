"""``python -m tierckpt.cli ARGS``: the ``tierckpt`` command."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
