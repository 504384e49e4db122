"""Fault-injection tools for users' own tests of checkpointing under failures.

:mod:`tierckpt.testing.netfaults` puts misbehaving network paths on loopback: :class:`FaultProxy` (forward,
refuse, silent, reset, slow), :class:`DenyingServer` (every request gets an S3-style ``403 AccessDenied``),
:func:`unused_port` and :func:`refused_url`.
"""

from __future__ import annotations

from .netfaults import MODES, DenyingServer, FaultProxy, refused_url, unused_port

__all__ = ["MODES", "DenyingServer", "FaultProxy", "refused_url", "unused_port"]
