"""Names of folders and files in a tier's root.

Invariants:
- A committed step lives in ``step-<step, 10+ digits>/`` and is committed iff that folder holds a valid
  ``manifest.json``. Everything else in the root is either another step or a leftover.
- Leftovers carry names only the manager makes (``.tmp-``, ``.trash-``); only those are ever removed by cleanup.
- Every file name in a manifest is a single safe path component (:func:`check_file_name`), so a path read from a
  manifest can never leave its step folder.
- Data and rank-manifest names carry a per-save id, so that a new save of a step written next to an old one (object
  stores) never overwrites the old files before the new ``manifest.json`` switches to them.
- On object stores (``Store.spread_keys``) a data file's name starts with its fan-out tag, two hex digits that
  are a pure function of the rest of the name (:func:`spread_name`): a step's data objects then spread over 256
  key prefixes (``step-<N>/00`` .. ``step-<N>/ff``), so that no prefix takes more than a small share of a save's
  or a restore's requests. The tag is part of the one path component: the step is still one folder, and what a
  manifest names still cannot leave it. Local tiers keep the plain names (:func:`plain_name`).
"""

from __future__ import annotations

import re
import secrets

import xxhash

from ..errors import CorruptCheckpointError

STEP_MANIFEST = "manifest.json"
LOCK_PREFIX = ".lock-rank"
RECORDS_FILE = "saves.jsonl"
#: the run a root belongs to (:mod:`tierckpt.tiers.identity`)
RUN_FILE = "run.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
#: Steps set aside by a rollback (``CheckpointManager.rollback_to``): never restored, listed or retained.
ASIDE_PREFIX = "aside-"
#: Where an object store's set-aside step keeps its manifest (its ``manifest.json`` is gone, so it is not committed).
ASIDE_MANIFEST = "manifest.aside.json"

_STEP_RE = re.compile(r"^step-(\d{10,20})$")
_SAFE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
_TMP_RE = re.compile(r"^\.tmp-(step-\d{10,20})(?:-r(\d{5}))?-[0-9a-f]{8,32}$")
#: The number of key prefixes a step's data objects spread over on an object store (two hex digits).
FANOUT = 256
_SPREAD_RE = re.compile(r"^([0-9a-f]{2})-(r\d{5}-.+)$")


def step_dir(step: int) -> str:
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def new_save_id() -> str:
    return secrets.token_hex(4)


def tmp_dir(step: int, save_id: str, rank: int | None = None) -> str:
    """A save's temporary folder; multi-rank saves add the rank, so each rank only ever cleans up its own."""
    middle = "" if rank is None else f"-r{rank:05d}"
    return f"{TMP_PREFIX}{step_dir(step)}{middle}-{save_id}"


def tmp_dir_rank(name: str) -> int | None:
    """The rank in a multi-rank temporary folder's name (None for single-rank ones or other names)."""
    m = _TMP_RE.match(name)
    return int(m.group(2)) if m and m.group(2) else None


def parse_tmp_dir(name: str) -> str | None:
    """The final step folder name a temporary folder was meant for, or None if it is not one of ours."""
    m = _TMP_RE.match(name)
    return m.group(1) if m else None


def trash_dir(name: str) -> str:
    return f"{TRASH_PREFIX}{name}-{new_save_id()}"


def aside_dir(name: str) -> str:
    """The folder name a step folder ``name`` is renamed to when a rollback sets it aside."""
    return f"{ASIDE_PREFIX}{name}-{new_save_id()}"


def is_leftover(name: str) -> bool:
    return name.startswith(TMP_PREFIX) or name.startswith(TRASH_PREFIX)


def rank_manifest_name(rank: int, save_id: str) -> str:
    return f"r{rank:05d}-{save_id}.manifest.json"


def data_file_name(rank: int, part: int, save_id: str) -> str:
    return f"r{rank:05d}-p{part:04d}-{save_id}.safetensors"


def fanout_tag(name: str) -> str:
    """The fan-out tag of plain data-file name ``name``: two lowercase hex digits, the low byte of its xxh3-64.
    The name holds the rank, the part and the save id (random per single-process save, derived from the step in a
    multi-rank job), so ranks, parts and consecutive steps land on unrelated tags, spread evenly over
    :data:`FANOUT`."""
    return f"{xxhash.xxh3_64_intdigest(name.encode()) % FANOUT:02x}"


def spread_name(name: str) -> str:
    """The object-store name of a data file: ``<tag>-<plain name>`` (``3a-r00003-p0000-<save id>.safetensors``),
    so that its key starts with ``step-<N>/<tag>``. Idempotent: a name that already carries its tag is returned
    as it is."""
    plain = plain_name(name)
    return f"{fanout_tag(plain)}-{plain}"


def plain_name(name: str) -> str:
    """A data file's name without its fan-out tag (the name the local tier uses); other names unchanged. Only a
    tag that is the name's own (:func:`fanout_tag` of the rest) is taken off."""
    m = _SPREAD_RE.match(name)
    return m.group(2) if m and fanout_tag(m.group(2)) == m.group(1) else name


def stored_name(name: str, spread: bool) -> str:
    """The name data file ``name`` is stored under in a store that spreads its keys (``spread``) or not."""
    return spread_name(name) if spread else plain_name(name)


def lock_name(rank: int) -> str:
    return f"{LOCK_PREFIX}{rank:05d}"


def check_file_name(name: object, *, step: int | None = None, path: str | None = None) -> str:
    """Reject anything but one plain path component (no separators, no ``..``, no leading dot)."""
    if not isinstance(name, str) or not _SAFE_RE.match(name) or ".." in name:
        raise CorruptCheckpointError(f"unsafe file name {name!r} in manifest", step=step, path=path)
    return name
