"""Prometheus metrics of a :class:`~tierckpt.CheckpointManager`'s saves and tiers (docs/metrics.md).

```python
from tierckpt.metrics import PrometheusMetrics
metrics = PrometheusMetrics()                  # prometheus_client's default REGISTRY
mgr = tierckpt.CheckpointManager("/nvme/ckpt", remote="s3://bucket/run", on_record=metrics)
metrics.attach(mgr)                            # the tier gauges read mgr.health() at each scrape
prometheus_client.start_http_server(9100)
```

Two sources, because they answer different questions:

- each save's :class:`~tierckpt.handle.SaveRecord` (``on_record``, once the save is resolved in every tier):
  histograms of stall, durable (local persist) and upload seconds, and counters of saves, bytes, failed saves,
  failed uploads and skipped uploads;
- :meth:`CheckpointManager.health`, read when the registry is collected (a scrape), not when a record arrives:
  while the remote is down no upload resolves and no record arrives for minutes, yet the upload lag must keep
  growing on the dashboard. The gauges are the newest committed step per tier, the upload lag in steps and
  seconds, and the remote's current streak of failed uploads.

Names (``namespace`` ``tierckpt``): ``tierckpt_save_stall_seconds``, ``tierckpt_save_durable_seconds``,
``tierckpt_save_upload_seconds`` (histograms); ``tierckpt_saves_total``, ``tierckpt_saved_bytes_total``,
``tierckpt_save_failures_total`` (the local tier failed), ``tierckpt_upload_failures_total``,
``tierckpt_uploads_skipped_total`` (counters); ``tierckpt_last_committed_step{tier="local"|"remote"}``,
``tierckpt_upload_lag_steps``, ``tierckpt_upload_lag_seconds``, ``tierckpt_remote_consecutive_failures``
(gauges, absent until a manager is attached; a tier's step is absent while it holds none or is not listed yet).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the module
    raise ImportError('tierckpt.metrics needs prometheus_client: pip install "tierckpt[prometheus]"') from exc

from .handle import SaveRecord

log = logging.getLogger(__name__)

__all__ = ["PrometheusMetrics", "STALL_BUCKETS", "DURABLE_BUCKETS"]

#: seconds training waits in ``save()``: milliseconds (a pinned GPU copy) to tens of seconds (a large CPU copy)
STALL_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: seconds until a save is durable locally or committed remotely: sub-second to an hour
DURABLE_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class _HealthCollector(Collector):
    """The tier gauges, computed from ``manager.health()`` each time the registry is collected."""

    def __init__(self, owner: PrometheusMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterator[Metric]:  # the names, so registering never calls health()
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        mgr = self._owner.manager
        families = self._families()
        if mgr is None:
            return
        try:
            health = mgr.health()
        except Exception as exc:  # a closed manager, a vanished folder: the scrape goes on without the gauges
            log.debug("tierckpt.metrics: health() failed: %s", exc)
            return
        step, lag_steps, lag_s, failures = families
        if health.local_step is not None:
            step.add_metric(["local"], health.local_step)
        if health.remote_step is not None:
            step.add_metric(["remote"], health.remote_step)
        lag_steps.add_metric([], health.upload_lag_steps)
        lag_s.add_metric([], health.upload_lag_s)
        failures.add_metric([], health.consecutive_failures)
        yield from families

    def _families(self) -> list[GaugeMetricFamily]:
        ns = self._owner.namespace
        return [
            GaugeMetricFamily(f"{ns}_last_committed_step", "Newest step committed in each tier", labels=["tier"]),
            GaugeMetricFamily(f"{ns}_upload_lag_steps", "Committed local steps newer than the remote's newest"),
            GaugeMetricFamily(f"{ns}_upload_lag_seconds",
                              "Seconds since the oldest local step not yet on the remote was committed"),
            GaugeMetricFamily(f"{ns}_remote_consecutive_failures", "Failed uploads in the remote's current streak"),
        ]


class PrometheusMetrics:
    """Exports a manager's saves and tiers with prometheus_client; an ``on_record`` hook (see the module doc).

    Args:
        registry: where the metrics are registered (None: prometheus_client's default ``REGISTRY``). One
            ``PrometheusMetrics`` per registry and namespace (prometheus_client refuses duplicate names).
        namespace: the metric name prefix.
        manager: the manager whose ``health()`` the gauges read; same as calling :meth:`attach` with it.
        stall_buckets / durable_buckets: histogram buckets (seconds) of the stall, and of the durable and upload
            times.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, namespace: str = "tierckpt",
                 manager: Any = None, stall_buckets: Sequence[float] = STALL_BUCKETS,
                 durable_buckets: Sequence[float] = DURABLE_BUCKETS) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.namespace = namespace
        self.manager: Any = None
        self._lock = threading.Lock()
        reg, ns = self.registry, namespace
        self.stall = Histogram("save_stall_seconds", "Seconds training waited in save() (the snapshot copy)",
                               namespace=ns, registry=reg, buckets=tuple(stall_buckets))
        self.durable = Histogram("save_durable_seconds", "Seconds from save() to durable in the local tier",
                                 namespace=ns, registry=reg, buckets=tuple(durable_buckets))
        self.upload = Histogram("save_upload_seconds", "Seconds from save() to committed in the remote tier",
                                namespace=ns, registry=reg, buckets=tuple(durable_buckets))
        self.saves = Counter("saves", "Saves resolved in every tier (failed ones included)", namespace=ns,
                             registry=reg)
        self.bytes = Counter("saved_bytes", "Bytes of tensor data saved", namespace=ns, registry=reg)
        self.save_failures = Counter("save_failures", "Saves that failed in the local tier", namespace=ns,
                                     registry=reg)
        self.upload_failures = Counter("upload_failures", "Saves whose upload to the remote tier failed",
                                       namespace=ns, registry=reg)
        self.uploads_skipped = Counter("uploads_skipped", "Saves never uploaded (superseded by a newer step, "
                                       "deleted locally first, set aside)", namespace=ns, registry=reg)
        self._collector = _HealthCollector(self)
        reg.register(self._collector)
        if manager is not None:
            self.attach(manager)

    def attach(self, manager: Any) -> PrometheusMetrics:
        """Read ``manager.health()`` for the tier gauges, and receive its records (unless this object is already
        one of its ``on_record`` hooks). Returns self."""
        manager.add_on_record(self)
        self.manager = manager
        return self

    def detach(self) -> None:
        """Stop reading the attached manager's health (its records still arrive if it has this hook)."""
        self.manager = None

    def unregister(self) -> None:
        """Remove every metric of this object from its registry."""
        for m in (self.stall, self.durable, self.upload, self.saves, self.bytes, self.save_failures,
                  self.upload_failures, self.uploads_skipped, self._collector):
            self.registry.unregister(m)

    def __call__(self, rec: SaveRecord) -> None:
        """The ``on_record`` hook: one resolved save."""
        with self._lock:  # one record's samples together (a scrape may still fall between two of them)
            self.saves.inc()
            if rec.persist_s is None:  # the local tier failed: nothing was saved
                if rec.error:
                    self.save_failures.inc()
                if rec.stall_s is not None:
                    self.stall.observe(rec.stall_s)
                return
            self.bytes.inc(rec.bytes)
            if rec.stall_s is not None:
                self.stall.observe(rec.stall_s)
            self.durable.observe(rec.persist_s)
            if rec.upload_s is not None:
                self.upload.observe(rec.upload_s)
            elif rec.error:
                self.upload_failures.inc()
            if rec.upload_skipped:
                self.uploads_skipped.inc()

    def __repr__(self) -> str:
        return f"PrometheusMetrics(namespace={self.namespace!r}, manager={self.manager!r})"
