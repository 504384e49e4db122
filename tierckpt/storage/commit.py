"""Commit protocols: how a step folder becomes visible, all at once or not at all.

A step is committed in a store iff ``step-<N>/manifest.json`` exists there and verifies; ``manifest.json`` is always
written last, after every other file of the step is durable. Two protocols implement that, chosen by the store's
capabilities (:func:`protocol_for`):

:class:`RenameCommit` (``atomic_rename`` stores: POSIX local disks, Lustre/NFS mounts)
    1. write every file into ``.tmp-step-<N>-<save id>/`` (each fsync-ed on close);
    2. write ``manifest.json`` into it, fsync, fsync the folder;
    3. rename the folder to ``step-<N>`` (atomically exchanging it with an old ``step-<N>`` if there is one), fsync
       the root; only then is the old copy removed.
    A crash before 3 leaves a ``.tmp-`` folder: :meth:`recover` finishes the rename if its manifest is complete and
    no ``step-<N>`` exists, and otherwise deletes it.

:class:`ManifestLastCommit` (object stores: no atomic rename, but atomic whole-object PUTs)
    1. write every file straight into ``step-<N>/`` under names carrying this save's id (so they never overwrite the
       files an older ``manifest.json`` there points to);
    2. PUT ``manifest.json``: the commit point, atomic on S3/GCS/Azure;
    3. delete files in the folder the new manifest does not name (an older save's; a file of an earlier save that
       a rank manifest names, carried over by an incremental upload, stays).
    A crash before 2 leaves files that no manifest names: a folder without ``manifest.json`` is never a checkpoint,
    and :meth:`recover` removes stray files.
"""

from __future__ import annotations

import abc
import logging

from ..errors import CheckpointError, CorruptCheckpointError, StorageError
from ..format import hashing, layout
from ..format.manifest import MAX_MANIFEST_BYTES, RankManifest, RankRef, StepManifest
from .base import Store, join

log = logging.getLogger(__name__)


class CommitProtocol(abc.ABC):
    """The order of calls: ``staging = begin(store, step, save_id)``; write files into ``staging``; write
    ``staging/manifest.json`` last; ``commit(store, staging, step)``. At start-up (with the tier's lock held):
    ``recover(store)``."""

    @abc.abstractmethod
    def begin(self, store: Store, step: int, save_id: str) -> str:
        """Prepare and return the folder that the step's files go into."""

    @abc.abstractmethod
    def commit(self, store: Store, staging: str, step: int) -> None:
        """Make the step visible. Called after ``manifest.json`` is durable in ``staging``."""

    @abc.abstractmethod
    def abort(self, store: Store, staging: str, step: int) -> None:
        """Remove what a failed save wrote, leaving any committed copy untouched."""

    @abc.abstractmethod
    def recover(self, store: Store) -> list[str]:
        """Finish or clean up what a crash left; returns a description of each action taken."""


def read_step_manifest(store: Store, folder: str, step: int | None) -> StepManifest | None:
    """The folder's verified step manifest, or None if it has none; CorruptCheckpointError if it is damaged."""
    rel = join(folder, layout.STEP_MANIFEST)
    try:
        raw = store.read_bytes(rel, max_size=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    except StorageError:
        raise  # the store could not be read: that says nothing about the checkpoint
    except (CheckpointError, MemoryError) as exc:  # larger than any manifest may be
        raise CorruptCheckpointError(f"step manifest unreadable: {exc}", step=step, tier=store.tier,
                                     path=f"{store.url}/{rel}", bad_files=[layout.STEP_MANIFEST]) from None
    return StepManifest.from_bytes(raw, step=step, path=f"{store.url}/{rel}")


def read_rank_manifest(store: Store, folder: str, ref: RankRef, manifest: StepManifest) -> RankManifest:
    """The rank manifest that ``ref`` of the already-read step ``manifest`` names in ``folder``, checked against it
    (size, checksum, rank, step, world size). Raises :class:`CorruptCheckpointError` naming the file where it is
    missing, unreadable or does not match, and :class:`StorageError` where the store could not be read."""
    step = manifest.step
    rel = join(folder, ref.name)
    where = f"{store.url}/{rel}"
    try:
        raw = store.read_bytes(rel, max_size=min(ref.size, MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        raise CorruptCheckpointError("rank manifest missing", step=step, tier=store.tier, path=where,
                                     bad_files=[ref.name]) from None
    except StorageError:
        raise  # the store could not be read (unreachable, denied): that says nothing about the checkpoint
    except Exception as exc:
        raise CorruptCheckpointError(f"rank manifest unreadable: {exc}", step=step, tier=store.tier, path=where,
                                     bad_files=[ref.name]) from None
    if len(raw) != ref.size or hashing.digest(raw).hex() != ref.checksum:
        raise CorruptCheckpointError("rank manifest does not match manifest.json", step=step, tier=store.tier,
                                     path=where, bad_files=[ref.name])
    try:
        rm = RankManifest.from_bytes(raw, step=step, path=where, digest_verified=True)
    except CorruptCheckpointError as exc:
        exc.bad_files.append(ref.name)
        exc.tier = store.tier
        raise
    if rm.rank != ref.rank or rm.step != step or rm.world_size != manifest.world_size:
        raise CorruptCheckpointError("rank manifest belongs to another step or rank", step=step, tier=store.tier,
                                     path=where, bad_files=[ref.name])
    return rm


class RenameCommit(CommitProtocol):
    def begin(self, store: Store, step: int, save_id: str) -> str:
        staging = layout.tmp_dir(step, save_id)
        store.makedirs(staging)
        return staging

    def commit(self, store: Store, staging: str, step: int) -> None:
        store.sync_dir(staging)
        store.replace_dir(staging, layout.step_dir(step))
        store.sync_dir("")

    def abort(self, store: Store, staging: str, step: int) -> None:
        store.remove(staging)

    def recover(self, store: Store) -> list[str]:
        actions = []
        for name in store.list(""):
            if name.startswith(layout.TRASH_PREFIX):
                store.remove(name)
                actions.append(f"removed {name}")
                continue
            final = layout.parse_tmp_dir(name)
            if final is None:
                continue
            step = layout.parse_step_dir(final)
            try:
                complete = read_step_manifest(store, name, step) is not None
            except CorruptCheckpointError:
                complete = False
            if complete and not store.exists(final):
                store.replace_dir(name, final)
                store.sync_dir("")
                actions.append(f"completed the commit of {final} from {name}")
                log.warning("tier %s: recovered step %s from %s/%s", store.tier, step, store.url, name)
            else:
                store.remove(name)
                actions.append(f"removed {name}")
        return actions


class ManifestLastCommit(CommitProtocol):
    def begin(self, store: Store, step: int, save_id: str) -> str:
        folder = layout.step_dir(step)
        store.makedirs(folder)
        return folder

    def commit(self, store: Store, staging: str, step: int) -> None:
        self._remove_unreferenced(store, staging, step)

    def abort(self, store: Store, staging: str, step: int) -> None:
        try:
            self._remove_unreferenced(store, staging, step)
        except CorruptCheckpointError:
            pass

    def recover(self, store: Store) -> list[str]:
        actions = store.discard_unfinished_uploads()  # a killed writer's multipart uploads: never part of a step
        for name in store.list(""):
            step = layout.parse_step_dir(name)
            if step is None:
                continue
            try:
                actions += self._remove_unreferenced(store, name, step)
            except CorruptCheckpointError:
                continue  # damaged manifest: leave everything for an operator (verify reports it)
        return actions

    @staticmethod
    def _remove_unreferenced(store: Store, folder: str, step: int) -> list[str]:
        manifest = read_step_manifest(store, folder, step)
        if manifest is None:
            keep: set[str] = set()
        else:
            keep = {layout.STEP_MANIFEST} | {r.name for r in manifest.ranks}
            # data files are named after the save id; the rank manifests name them exactly, but a prefix match on the
            # save id keeps this independent of reading every rank manifest.
        doomed = [name for name in store.list(folder)
                  if name not in keep and (manifest is None or f"-{manifest.save_id}." not in name)]
        if doomed and manifest is not None:  # an earlier save's file carried over into this step stays
            doomed = [name for name in doomed if name not in _named_files(store, folder, manifest)]
        removed = []
        for name in doomed:
            store.remove(join(folder, name))
            removed.append(f"removed {folder}/{name}")
        if manifest is None and not store.list(folder):
            store.remove(folder)
        return removed


def _named_files(store: Store, folder: str, manifest: StepManifest) -> set[str]:
    """The data files the rank manifests of committed ``manifest`` name in its own folder (read only where the
    folder holds files of another save: an incremental upload carries an earlier save's file over under its own
    name). CorruptCheckpointError when a rank manifest does not match its reference: nothing is removed then."""
    return {f.name for ref in manifest.ranks for f in read_rank_manifest(store, folder, ref, manifest).files
            if f.in_step is None}


def protocol_for(store: Store) -> CommitProtocol:
    return RenameCommit() if store.atomic_rename else ManifestLastCommit()
