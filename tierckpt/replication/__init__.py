"""Replication: the policy that decides what is uploaded and what local retention may delete
(:mod:`.policy`), and the component that runs it on a background thread (:mod:`.replicator`)."""

from .health import Health, UploadChannel
from .policy import ReplicationPolicy, UploadPlan
from .replicator import Replicator

__all__ = ["Health", "ReplicationPolicy", "Replicator", "UploadChannel", "UploadPlan"]
