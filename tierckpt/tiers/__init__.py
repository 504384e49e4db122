"""Tiers: moving snapshots between host memory, the local tier and the remote tier. Never imports torch."""
