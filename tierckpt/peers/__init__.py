"""Peer copies of each node's committed steps on partner nodes (``CheckpointManager(peer_replicas=...)``): the
ring and the replicas' layout (:mod:`.replicas`, no torch), the wire format (:mod:`.wire`), the server
(:mod:`.server`) and each rank's part (:mod:`.node`, which the manager imports)."""

from .replicas import Ring

__all__ = ["Ring"]
