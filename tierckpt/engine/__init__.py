"""The checkpoint manager's private components, built and wired by :class:`tierckpt.CheckpointManager`.

- :mod:`.core`: :class:`~.core.Engine`, what the manager shares with the modules below (tiers, pools, staging,
  coordinator), and :class:`~.core.Components`, the manager's components as ``mgr.components`` shows them.
- :mod:`.pipeline`: :class:`~.pipeline.SavePipeline`, a save from the caller's copy to a committed local step.
- :mod:`.lifecycle`: the components' start-up (recovery, peers, replication), the wait for background work, the
  order they stop in.
- :mod:`.records`: the save records, ``saves.jsonl``, and the background errors re-raised on the next call.
- :mod:`.restore`: choosing, verifying and loading a step into the live state, with fallback.
- :mod:`.load`: a step read back as plain values, without a live state (``load()``, export, the DCP reader).
- :mod:`.reads`: the manager's read calls from their arguments to the listing and the step read.
- :mod:`.sharded`: a multi-rank job's save and restore agreements.
- :mod:`.messages`: what those agreements carry (JSON of a fixed set of types, never pickle).
- :mod:`.rollback`: ``rollback_to``'s rules.
- :mod:`.uploads`: the remote tier as the manager's calls see it (run identity, listings in an outage, health).

Nothing here is public: import :mod:`tierckpt`.
"""
