"""Misbehaving network paths on loopback, for tests of checkpointing against a real or emulated object store.

:class:`FaultProxy` is a TCP forwarder placed between a client (s3fs, boto, ``http.client``...) and a server;
its mode, switched at run time, makes the path forward normally, refuse connections, accept and never answer,
reset every connection, or deliver bytes slowly. :class:`DenyingServer` is an HTTP server that answers every
request with an S3-style ``403 AccessDenied``. :func:`unused_port` and :func:`refused_url` name a loopback
port nothing listens on.

Everything listens on 127.0.0.1 only, and :class:`FaultProxy` only forwards to loopback upstreams: these are
test tools, never to be put in front of a real network. Stdlib only; all threads are daemon threads whose
loops poll with timeouts of at most 0.2 s, so ``stop()`` returns promptly.
"""

from __future__ import annotations

from ._loopback import refused_url, unused_port
from .denying import DenyingServer
from .proxy import MODES, FaultProxy

__all__ = ["MODES", "DenyingServer", "FaultProxy", "refused_url", "unused_port"]
