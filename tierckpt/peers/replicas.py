"""Where a node keeps its partners' replicas in its local tier, and the ring that says who holds whose.

Layout, in the local root of the node that holds them::

    replicas/node-<k>/step-<N>/...        node k's committed step N, the files of its step folder as they are
    replicas/node-<k>/.tmp-step-<N>-<id>/ a replica being received (never read; removed at start-up)
    replicas/.fetch-r<rank>/step-<N>/...  the shard a replaced node's rank fetched back from a partner

A rank that restored its shard from a fetched copy commits it back into the node's own local tier
(:func:`commit_fetched`), in the layout of the node's own saves: its files move into ``step-<N>/`` (data files
first, its rank manifest last, then the folder is fsync-ed), and the rank that finds every rank manifest the fetched
``manifest.json`` names in place writes that ``manifest.json`` (a temporary name, one rename, fsync): so the step
is committed only once every rank of the node has moved its shard, whichever rank comes last, and a rank that never
restored from the replica leaves the folder uncommitted (never a checkpoint).

A replica is committed the way a local step is: every file is received, checked against the sender's checksum
and fsync-ed inside a temporary folder, and one ``rename`` gives it its ``step-<N>`` name (then the parent folder
is fsync-ed). A folder named ``step-<N>`` always holds a whole copy with its ``manifest.json``; a transfer killed
half-way leaves only a temporary folder, which no listing counts. Nodes are numbered by their lowest rank
(:class:`Ring`); a job restarted with the same ranks on the same number of nodes numbers them the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from dataclasses import dataclass

from ..errors import CheckpointError, CorruptCheckpointError
from ..format import hashing, layout
from ..format.manifest import MAX_MANIFEST_BYTES, RankManifest, StepManifest, file_rel
from ..storage.base import join
from ..storage.local import LocalStore

log = logging.getLogger(__name__)

ROOT = "replicas"


@dataclass(frozen=True)
class Ring:
    """The nodes of a job in a ring: ``node`` is this rank's node (0 .. ``nodes`` - 1, in the order of the nodes'
    lowest ranks), and each node's committed steps go to the ``copies`` nodes after it."""

    node: int
    nodes: int
    copies: int

    def partners(self, node: int | None = None) -> list[int]:
        """The nodes that hold ``node``'s replicas (default: this one's), nearest first."""
        n = self.node if node is None else node
        return [(n + i) % self.nodes for i in range(1, self.copies + 1)]

    def sources(self) -> list[int]:
        """The nodes whose replicas this node holds."""
        return [(self.node - i) % self.nodes for i in range(1, self.copies + 1)]


def node_dir(node: int) -> str:
    return f"{ROOT}/node-{node:05d}"


def fetch_root(local_root: str, rank: int) -> str:
    return os.path.join(local_root, ROOT, f".fetch-r{rank:05d}")


def committed_steps(local_root: str, node: int) -> list[int]:
    """Node ``node``'s replica steps held under ``local_root`` that are committed (their ``manifest.json`` is
    there), oldest first."""
    folder = os.path.join(local_root, node_dir(node))
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    for name in names:
        s = layout.parse_step_dir(name)
        if s is not None and os.path.isfile(os.path.join(folder, name, layout.STEP_MANIFEST)):
            steps.append(s)
    return sorted(steps)


def held_nodes(local_root: str) -> list[int]:
    """The nodes whose replicas are kept under ``local_root`` (any step, committed or not)."""
    try:
        names = os.listdir(os.path.join(local_root, ROOT))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        if name.startswith("node-") and name[5:].isdigit():
            out.append(int(name[5:]))
    return sorted(out)


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def clean_leftovers(local_root: str) -> list[str]:
    """Remove the temporary folders of replicas whose transfer never finished (a crash mid-transfer) and of
    fetches; returns what was removed."""
    removed = []
    for node in held_nodes(local_root):
        folder = os.path.join(local_root, node_dir(node))
        for name in os.listdir(folder):
            if layout.is_leftover(name):
                remove_tree(os.path.join(folder, name))
                removed.append(os.path.join(folder, name))
    return removed


def retain(local_root: str, node: int, keep: int) -> list[int]:
    """Keep node ``node``'s newest ``keep`` committed replicas; returns the steps removed (each renamed to a
    trash name first, so that no listing meets a half-removed step)."""
    folder = os.path.join(local_root, node_dir(node))
    steps = committed_steps(local_root, node)
    gone = steps[:-keep] if keep > 0 else steps
    for s in gone:
        src = os.path.join(folder, layout.step_dir(s))
        trash = os.path.join(folder, layout.trash_dir(layout.step_dir(s)))
        try:
            os.rename(src, trash)
        except OSError as exc:
            log.warning("tier peer: cannot remove node %d's replica of step %d at %s: %s", node, s, src, exc)
            continue
        remove_tree(trash)
        log.info("tier peer: removed node %d's replica of step %d (keeping %d) at %s", node, s, keep, folder)
    return gone


def replica_sources(local: LocalStore, step: int) -> list[tuple[str, int, str | bytes]]:
    """What a replica of the node's committed ``step`` consists of, in the order sent (data files, rank manifests,
    ``manifest.json`` last): (name, size, the file's path or its bytes). A step without references is its folder's
    files as they are. An incremental step (``refs``) is carried whole: the earlier steps' files its rank manifests
    reference are sent into the replica's own folder, each rank manifest that referenced one is re-sealed without
    ``in_step`` (its files keep their ``cuts``, docs/format.md section 13), and ``manifest.json`` names those rank
    manifests and no ``refs``: a replica never depends on a step its holder may not have, and a restore from it
    verifies every byte against it as from any step. Raises :class:`CheckpointError` (or ``OSError``) where the
    step is not committed locally or its manifests do not verify."""
    folder = layout.step_dir(step)
    try:
        raw = local.read_bytes(join(folder, layout.STEP_MANIFEST), max_size=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointError("not committed locally (retention removed it?)", step=step, tier="local",
                              path=local.path(folder)) from None
    manifest = StepManifest.from_bytes(raw, step=step, path=local.path(join(folder, layout.STEP_MANIFEST)))
    if not manifest.refs:
        names = [n for n in local.list(folder) if n != layout.STEP_MANIFEST]
        return [*((n, local.size(join(folder, n)), local.path(join(folder, n))) for n in names),
                (layout.STEP_MANIFEST, len(raw), raw)]
    data: dict[str, tuple[str, int, str | bytes]] = {}
    manifests: list[tuple[str, int, str | bytes]] = []
    refs = []
    for ref in manifest.ranks:
        rank_raw = local.read_bytes(join(folder, ref.name), max_size=MAX_MANIFEST_BYTES)
        if hashing.digest(rank_raw).hex() != ref.checksum:
            raise CorruptCheckpointError(f"{ref.name} does not match manifest.json", step=step, tier="local",
                                         path=local.path(join(folder, ref.name)), bad_files=[ref.name])
        rm = RankManifest.from_bytes(rank_raw, step=step, path=local.path(join(folder, ref.name)))
        for f in rm.files:
            if f.name in data:
                raise CorruptCheckpointError(f"{f.name} is listed twice", step=step, tier="local",
                                             path=local.path(folder), bad_files=[f.name])
            data[f.name] = (f.name, f.size, local.path(file_rel(step, f)))
        if any(f.in_step is not None for f in rm.files):
            rank_raw = dataclasses.replace(rm, files=tuple(dataclasses.replace(f, in_step=None)
                                                           for f in rm.files)).to_bytes()
            ref = dataclasses.replace(ref, size=len(rank_raw), checksum=hashing.digest(rank_raw).hex())
        manifests.append((ref.name, len(rank_raw), rank_raw))
        refs.append(ref)
    carried = dataclasses.replace(manifest, ranks=tuple(refs), refs=(), shared_bytes=0).to_bytes()
    return [*data.values(), *manifests, (layout.STEP_MANIFEST, len(carried), carried)]


def fetch_rel(rank: int, step: int) -> str:
    """The folder of rank ``rank``'s fetched copy of ``step``, relative to the local root."""
    return f"{ROOT}/.fetch-r{rank:05d}/{layout.step_dir(step)}"


def commit_fetched(local: LocalStore, step: int, rank: int) -> bool:
    """Commit rank ``rank``'s shard of ``step``, fetched from a partner and already read and verified by a
    restore, into the local tier as the node's own step (see the module docstring); returns whether this call
    committed the step's ``manifest.json``. Where the local tier already holds a committed ``step``, only a copy of
    the same save (the same ``manifest.json``) is repaired with the fetched files; another save is left alone. The
    fetched folder is removed. Raises ``OSError`` or :class:`CheckpointError` (the caller logs: the restore itself
    succeeded)."""
    src = fetch_rel(rank, step)
    folder = layout.step_dir(step)
    try:
        raw = local.read_bytes(join(src, layout.STEP_MANIFEST), max_size=MAX_MANIFEST_BYTES)
        manifest = StepManifest.from_bytes(raw, step=step, path=local.path(src))
        ref = next((r for r in manifest.ranks if r.rank == rank), None)
        if ref is None:
            raise CorruptCheckpointError(f"the fetched manifest.json names no shard of rank {rank}", step=step)
        rank_raw = local.read_bytes(join(src, ref.name), max_size=MAX_MANIFEST_BYTES)
        if hashing.digest(rank_raw).hex() != ref.checksum:
            raise CorruptCheckpointError(f"{ref.name} does not match the fetched manifest.json", step=step)
        rm = RankManifest.from_bytes(rank_raw, step=step, path=local.path(join(src, ref.name)))
        if any(f.in_step is not None for f in rm.files):
            raise CheckpointError("the fetched shard references earlier steps' files", step=step)
        try:
            have: bytes | None = local.read_bytes(join(folder, layout.STEP_MANIFEST), max_size=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            have = None
        if have is not None and have != raw:
            log.info("tier peer: rank %d: the local tier holds another save of step %d (%s): the fetched copy is not "
                     "committed there", rank, step, local.path(folder))
            return False
        local.makedirs(folder)
        for f in rm.files:  # data files first, the rank manifest last: present, it says the shard is whole
            local.move_into(join(src, f.name), join(folder, f.name))
        local.move_into(join(src, ref.name), join(folder, ref.name))
        local.sync_dir(folder)
        if have is not None:
            return False
        present = set(local.list(folder))
        if not all(r.name in present for r in manifest.ranks):
            return False  # a rank of the node still moving its shard commits the step
        local.put_atomic(join(folder, layout.STEP_MANIFEST), raw)
        log.info("tier peer: step %d, fetched from a partner, committed into the local tier %s", step,
                 local.path(folder))
        return True
    finally:
        remove_tree(os.path.dirname(local.path(src)))

