"""The DCP storage reader of :mod:`tierckpt.dcp`.

Byte items: DCP's ``DefaultLoadPlanner.load_bytes`` unpickles them with ``torch.load(weights_only=False)``, and
tierckpt's checksums are unkeyed (they catch damage, not an attacker who can write a tier), so the reader hands on
only what torch's weights-only unpickler accepts (:func:`_weights_only`) unless told the checkpoint is trusted
(``allow_pickle=True``).
"""

from __future__ import annotations

import io
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
)
from torch.futures import Future

from .. import readonly
from ..engine import load as _load
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from ..tiers.listing import list_tiers
from ..tiers.reader import read_step
from ..tiers.verify import verify_step
from ._metadata import DATA_KEY, META_KEY, Record, _parse_step, metadata_from_json

if TYPE_CHECKING:
    from ..format.manifest import StepManifest
    from ..manager import CheckpointManager
    from ..storage.base import Store

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ reader
@dataclass
class _Choice:
    step: int
    metadata: Metadata
    stores: dict[int, Store]  # stored rank -> the tier copy that verified (or that holds it, verify=False)
    manifests: dict[str, StepManifest]


class StorageReader(_storage.StorageReader):
    """DCP storage reader over ``mgr``'s tiers.

    ``read_metadata`` settles on a step before DCP plans: ``step=N`` exactly (or an error), else the newest step
    that every rank of the job found intact. With ``verify=True`` (default) "intact" means every data file of every
    saved rank's shard was read and matched against its checksums, in the local tier if it holds that shard, else
    the remote (a corrupt local copy falls back to the remote one); loading rank ``i`` of ``M`` checks the shards
    of saved ranks ``i, i + M, ...`` (with the same world size: the shard it reads). A step with a shard that has no
    intact copy is skipped for the next older one (``step=None``) or raises (``step=N``). A multi-rank job agrees
    on the step through ``all_gather_object`` on ``process_group`` (default: the default group, if one is
    initialised). The checked files are read twice (once to verify, once for the records); ``verify=False`` skips
    the first pass: every byte is still verified when read, and a corrupt local record is read from the remote, but
    a step with no intact copy then fails in ``read_data`` instead of falling back to an older step.

    ``read_data`` reads, for each stored rank it needs, exactly the records of its plan (verified), narrows each to
    the requested box, and copies it into DCP's target; byte items are handed to ``planner.load_bytes``.

    Byte items (DCP's non-tensor values, ``torch.save``d) are unpickled by DCP's default planner with
    ``weights_only=False``, which runs whatever a pickle names. By default (``allow_pickle=False``) each one is
    first loaded with ``torch.load(weights_only=True)`` (plain Python values, containers, tensors, dtypes, and
    what ``torch.serialization.add_safe_globals`` allows), and the planner gets that object saved again by
    ``torch.save``, never the stored bytes; an item that does not load that way raises :class:`CheckpointError`
    naming its FQN, the step and the global torch refused, before the planner sees its bytes and before any tensor
    of the saved rank that holds it is loaded (saved ranks holding byte items are read first). ``allow_pickle=True``
    hands the stored bytes on as DCP's own reader does: only for checkpoints whose every tier you trust."""

    def __init__(self, mgr: CheckpointManager, step: int | None = None, *, source: str = "auto", verify: bool = True,
                 process_group: Any = None, allow_pickle: bool = False) -> None:
        super().__init__()
        if source not in ("auto", "local", "remote"):
            raise ValueError(f"source must be 'auto', 'local' or 'remote', got {source!r}")
        if source == "remote" and mgr.remote is None:
            raise ValueError("source='remote' but this manager has no remote tier")
        self.mgr = mgr
        self.step = None if step is None else _parse_step(step)
        self.source = source
        self.verify = verify
        self.process_group = process_group
        self.allow_pickle = allow_pickle
        self.reset()

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.step = _parse_step(checkpoint_id)
        self.is_coordinator = False
        self._choice: _Choice | None = None
        self._error: BaseException | None = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    @property
    def loaded_step(self) -> int | None:
        """The step that ``read_metadata`` settled on (None before, or when it failed)."""
        return None if self._choice is None else self._choice.step

    # The parameter is deliberately not named ``kwargs``: DCP >= 2.6 calls ``read_metadata(rank=...)`` again when
    # the first call fails and then loads without collectives, which a tierckpt step never needs.
    def read_metadata(self, *args: Any, **_options: Any) -> Metadata:
        """The step's DCP metadata (see the class docstring). Errors are kept and raised from
        ``set_up_storage_reader``, so that DCP reports tierckpt's exception itself (in its ``CheckpointException``)
        on every torch version; an empty ``Metadata`` is returned meanwhile."""
        if self._choice is None and self._error is None:
            try:
                self._choice = self._settle()
            except Exception as exc:  # noqa: BLE001 - re-raised in set_up_storage_reader
                self._error = exc
        if self._choice is None:
            return Metadata(state_dict_metadata={})
        return self._choice.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self._error is not None:
            raise self._error

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # -------------------------------------------------------------------------------- choosing the step
    def _readers(self) -> readonly.Reader:
        """Thread pools for one read (any rank's records; the rank given per call), closed when it ends."""
        return readonly.Reader(threads=max(1, self.mgr.options.writer_threads))

    def _tiers(self) -> list[Store]:
        return [s for s in (self.mgr.local, self.mgr.remote) if s is not None and self.source in ("auto", s.tier)]

    def _settle(self) -> _Choice:
        self.mgr.wait_persisted()  # a save still being written locally is loadable once committed
        tiers = self._tiers()
        urls = ", ".join(t.url for t in tiers)
        group = self.process_group
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        me, size = (dist.get_rank(group), dist.get_world_size(group)) if multi else (0, 1)
        listing = None
        candidates: list[int] = []
        err: BaseException | None = None
        try:
            listing = list_tiers(tiers, deadline_s=self.mgr.options.remote_timeout_s)
            listing.require(self.step, urls)
            candidates = [self.step] if self.step is not None else sorted(listing.known(), reverse=True)
        except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
            err = exc
        tried: dict[int, _Choice | BaseException] = {}

        def attempt(s: int) -> _Choice | BaseException:
            if s not in tried:
                try:
                    tried[s] = self._try_step(s, tiers, listing, me, size)
                except Exception as exc:  # noqa: BLE001
                    tried[s] = exc
            return tried[s]

        bound: int | None = None
        while True:
            mine: int | None = None
            if err is None:
                for s in candidates:
                    if bound is not None and s > bound:
                        continue
                    if isinstance(attempt(s), _Choice):
                        mine = s
                        break
            if not multi:
                answers = [(mine, None if err is None else repr(err))]
            else:
                answers = [None] * dist.get_world_size(group)
                dist.all_gather_object(answers, (mine, None if err is None else repr(err)), group=group)
            if err is not None:
                raise err
            failed = [(r, e) for r, (m, e) in enumerate(answers) if e is not None]
            if failed:
                r, e = failed[0]
                raise CheckpointError(f"tierckpt.dcp: rank {r} could not list its tiers: {e}", step=self.step)
            steps = [m for m, _ in answers]
            if any(m is None for m in steps):
                raise self._none_error(candidates, tried, [r for r, m in enumerate(steps) if m is None], urls)
            low = min(steps)
            if all(m == low for m in steps):
                choice = attempt(low)
                assert isinstance(choice, _Choice)
                if self.step is None and low != candidates[0]:
                    log.warning("tierckpt.dcp: loading step %d; newer step(s) %s have no intact copy on some rank",
                                low, [s for s in candidates if s > low])
                return choice
            bound = low

    def _none_error(self, candidates: list[int], tried: dict, ranks: list[int], urls: str) -> CheckpointError:
        errors = [e for s in candidates if isinstance(e := tried.get(s), BaseException)]
        where = "" if ranks == [0] and not (dist.is_available() and dist.is_initialized()) else f" on rank(s) {ranks}"
        if self.step is not None:
            if errors and isinstance(errors[0], CheckpointError):
                e = errors[0]
                return type(e)(f"step {self.step}{where}: {e.args[0] if e.args else e}", step=self.step,
                               tier=e.tier, path=e.path) if isinstance(e, (CheckpointNotFoundError,
                                                                            CorruptCheckpointError)) else e
            return CheckpointNotFoundError(f"step {self.step} has no intact copy{where}", step=self.step, path=urls)
        if not candidates:
            return CheckpointNotFoundError("no committed checkpoint in any tier", path=urls)
        msg = f"no committed step ({len(candidates)}) loads{where}; newest error: {errors[0] if errors else '?'}"
        if any(isinstance(e, CorruptCheckpointError) for e in errors):
            return CorruptCheckpointError(msg, step=candidates[0], path=urls)
        return CheckpointNotFoundError(msg, step=candidates[0], path=urls)

    def _try_step(self, step: int, tiers: list[Store], listing: Any, me: int, size: int) -> _Choice:
        """Step ``step`` checked on loading rank ``me`` of ``size``: a copy of the shard of each saved rank ``r``
        with ``r % size == me`` (verified with ``verify``; the job as a whole checks every saved rank, each once,
        and with the same world size each rank checks the shard it reads), and the DCP metadata from saved rank 0's
        shard. Raises a :class:`CheckpointError` naming what is missing or corrupt."""
        holders = [s for s in tiers if step in listing.steps.get(s.tier, set())]
        if not holders:
            raise CheckpointNotFoundError("no tier holds this step", step=step, path=", ".join(t.url for t in tiers))
        manifests: dict[str, StepManifest] = {}
        problems: list[CheckpointError] = []
        for store in holders:
            try:
                manifests[store.tier] = read_step(store, step)
            except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                problems.append(exc)
        if not manifests:
            raise problems[0]
        world = next(iter(manifests.values())).world_size
        stores: dict[int, Store] = {}
        for rank in range(me, world, size):
            for store in holders:
                m = manifests.get(store.tier)
                if m is None or (m.holds_ranks is not None and rank not in m.holds_ranks):
                    continue
                if self.verify:
                    report = verify_step(store, step, ranks=[rank], threads=max(1, self.mgr.options.writer_threads))
                    if not report.ok:
                        log.warning("tierckpt.dcp: step %d, rank %d's shard in tier %s is corrupt (%s); files: %s",
                                    step, rank, store.tier, "; ".join(report.errors), ", ".join(report.bad_files))
                        problems.append(CorruptCheckpointError(
                            f"rank {rank}'s shard: {'; '.join(report.errors)}", step=step, tier=store.tier,
                            path=store.url, bad_files=list(report.bad_files)))
                        continue
                stores[rank] = store
                break
            else:
                corrupt = any(isinstance(p, CorruptCheckpointError) for p in problems)
                cls = CorruptCheckpointError if corrupt else CheckpointNotFoundError
                raise cls(f"no intact copy of rank {rank}'s shard" + (f" ({problems[-1]})" if problems else ""),
                          step=step, tier="+".join(s.tier for s in holders), path=holders[0].url)
        text = None
        first = stores.get(0)
        for store in ([first] if first is not None else []) + [s for s in holders if s is not first]:
            m = manifests.get(store.tier)
            if m is None or (m.holds_ranks is not None and 0 not in m.holds_ranks):
                continue
            try:
                with self._readers() as readers:
                    text = _load.load_rank_keys(readers, store, m, 0, [META_KEY])[META_KEY]
                break
            except StateMismatchError:
                raise CheckpointError(f"step {step} was not saved through tierckpt.dcp (rank 0's state has no "
                                      f"{META_KEY!r})", step=step, tier=store.tier, path=store.url) from None
            except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                problems.append(exc)
        if not isinstance(text, str):
            raise problems[-1] if problems else CheckpointNotFoundError(
                "no tier here holds saved rank 0's shard, which holds the DCP metadata", step=step,
                tier="+".join(s.tier for s in holders), path=holders[0].url)
        md = metadata_from_json(text, step=step)
        return _Choice(step, md, stores, manifests)

    # -------------------------------------------------------------------------------- reading
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        choice = self._choice
        if choice is None:
            raise self._error or RuntimeError("tierckpt.dcp: read_data before read_metadata")
        storage: dict[MetadataIndex, Record] = choice.metadata.storage_data
        by_rank: dict[int, list[Any]] = {}
        for item in plan.items:
            rec = storage.get(item.storage_index)
            if rec is None:
                raise CorruptCheckpointError(f"DCP metadata has no storage for {item.storage_index}", step=choice.step)
            by_rank.setdefault(rec.rank, []).append((item, rec))
        # saved ranks holding byte items first: a refused one stops the load before most tensors are copied
        order = sorted(by_rank, key=lambda r: (not any(i.type == LoadItemType.BYTE_IO for i, _ in by_rank[r]), r))
        for rank in order:
            items = by_rank[rank]
            values = self._read_rank(choice, rank, {rec.key for _, rec in items})
            byte_items: dict[str, bytes] = {}  # every byte item of the rank checked before any of its items loads
            for item, rec in items:
                if item.type == LoadItemType.BYTE_IO:
                    value = values[rec.key]
                    if not isinstance(value, bytes):
                        raise CorruptCheckpointError(f"{rec.key!r} of rank {rank} is not bytes", step=choice.step)
                    byte_items[rec.key] = value if self.allow_pickle else _weights_only(
                        value, item.storage_index.fqn, rank, choice.step)
            for item, rec in items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(byte_items[rec.key]))
                    continue
                value = values[rec.key]
                if not isinstance(value, torch.Tensor):
                    raise CorruptCheckpointError(f"{rec.key!r} of rank {rank} is not a tensor", step=choice.step)
                src = narrow_tensor_by_index(value, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != src.size():
                    raise CorruptCheckpointError(f"{item.storage_index}: stored box {tuple(src.size())} does not fit "
                                                 f"the target {tuple(target.size())}", step=choice.step)
                target.copy_(src)
                planner.commit_tensor(item, target)
            del values
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_rank(self, choice: _Choice, rank: int, names: set[str]) -> dict[str, Any]:
        """Records ``names`` of stored rank ``rank``: from the copy chosen in ``read_metadata``, else any other tier
        that holds its shard (each byte verified either way)."""
        first = choice.stores.get(rank)
        order = ([first] if first is not None else []) + [s for s in self._tiers() if s is not first]
        failures: list[CheckpointError] = []
        for store in order:
            m = choice.manifests.get(store.tier)
            if m is None:
                try:
                    m = choice.manifests[store.tier] = read_step(store, choice.step)
                except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                    failures.append(exc)
                    continue
            if m.holds_ranks is not None and rank not in m.holds_ranks:
                continue
            try:
                with self._readers() as readers:
                    return _load.load_rank_entries(readers, store, m, rank, DATA_KEY, names)
            except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
                log.warning("tierckpt.dcp: step %d, rank %d's records in tier %s: %s; trying the next copy",
                            choice.step, rank, store.tier, exc)
                failures.append(exc)
        if failures:
            raise failures[-1]
        raise CheckpointNotFoundError(f"no tier here holds rank {rank}'s shard", step=choice.step)


#: torch's line naming what its weights-only unpickler refused (``Unsupported global: GLOBAL builtins.open ...``)
_REFUSED_RE = re.compile(r"(?:WeightsUnpickler error|Unsupported)[^\n]*")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def _weights_only(data: bytes, fqn: str, rank: int, step: int) -> bytes:
    """``data`` (a byte item DCP saved with ``torch.save``) loaded by torch's weights-only unpickler and saved again:
    bytes that hold only what that unpickler allowed, which DCP's planner may then unpickle with
    ``weights_only=False`` (what the stored bytes name is never passed on, so a difference between the two
    unpicklers' readings of them cannot matter).

    Raises :class:`CheckpointError` naming ``fqn``, saved rank ``rank`` and ``step`` when the bytes do not load that
    way: a pickle of a type torch does not allow by default, or one crafted to run code."""
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any refusal or failure of the weights-only unpickler
        text = _ANSI_RE.sub("", str(exc))
        found = _REFUSED_RE.search(text)
        why = (found.group(0) if found else text.strip().splitlines()[0] if text.strip() else type(exc).__name__)
        why = why.split(". Please use", 1)[0].rstrip(". ")  # torch's own advice follows ours below
        log.warning("tierckpt.dcp: step %d: refused byte item %r of saved rank %d: %s", step, fqn, rank, why)
        raise CheckpointError(
            f"tierckpt.dcp: byte item {fqn!r} (saved rank {rank}) does not load with torch.load(weights_only=True): "
            f"{why}. DCP's planner would unpickle it with weights_only=False, running whatever it names, so it is "
            "not handed on. For a checkpoint whose every tier you trust, load with "
            "tierckpt.dcp.StorageReader(mgr, allow_pickle=True), or allow its types with "
            "torch.serialization.add_safe_globals([...])", step=step) from None
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()
