"""Peer copies of each node's committed steps on partner nodes (``CheckpointManager(peer_replicas=...)``)."""

from .node import Peers, make_ring
from .replicas import Ring

__all__ = ["Peers", "Ring", "make_ring"]
