"""tierckpt.metrics: Prometheus metrics from real saves, read back from the exposition text."""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tierckpt import CheckpointManager, UploadError  # noqa: E402
from tierckpt.handle import SaveRecord  # noqa: E402
from tierckpt.metrics import PrometheusMetrics  # noqa: E402
from tierckpt.testing import refused_url  # noqa: E402


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((10_000,), float(step)), "step": step}


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """Every sample of the exposition text, as {(name, sorted labels): value}."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def refused_manager(tmp_path: Path, **kw: Any) -> CheckpointManager:
    pytest.importorskip("s3fs")
    return CheckpointManager(tmp_path / "c", remote="s3://bucket/run", remote_timeout_s=2, upload_deadline_s=3,
                             storage_options={"client_kwargs": {"endpoint_url": refused_url()}, "key": "k",
                                              "secret": "s"}, **kw)


def test_successful_saves_fill_histograms_counters_and_tier_gauges(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    metrics = PrometheusMetrics(reg)
    with CheckpointManager(tmp_path / "c", remote=str(tmp_path / "r"), on_record=metrics) as mgr:
        metrics.attach(mgr)
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
        mgr.wait()
        records = mgr.records()
        got = scrape(reg)
    assert len(records) == 3
    assert got[("tierckpt_saves_total", ())] == 3  # attach() did not add a second hook: no double counting
    assert got[("tierckpt_saved_bytes_total", ())] == sum(r.bytes for r in records) >= 3 * 40_000
    for name in ("stall", "durable", "upload"):
        assert got[(f"tierckpt_save_{name}_seconds_count", ())] == 3
    assert got[("tierckpt_save_stall_seconds_sum", ())] == pytest.approx(sum(r.stall_s for r in records))
    assert got[("tierckpt_save_upload_seconds_sum", ())] == pytest.approx(sum(r.upload_s for r in records))
    assert got[("tierckpt_upload_failures_total", ())] == 0
    assert got[("tierckpt_save_failures_total", ())] == 0
    assert got[("tierckpt_last_committed_step", (("tier", "local"),))] == 3
    assert got[("tierckpt_last_committed_step", (("tier", "remote"),))] == 3
    assert got[("tierckpt_upload_lag_steps", ())] == 0
    assert got[("tierckpt_upload_lag_seconds", ())] == 0
    assert got[("tierckpt_remote_consecutive_failures", ())] == 0


def test_a_refused_remote_counts_failures_and_the_lag_grows_between_scrapes(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    metrics = PrometheusMetrics(reg, namespace="ck")
    mgr = refused_manager(tmp_path, on_record=metrics)
    metrics.attach(mgr)
    try:
        handle = mgr.save(1, _state(1))
        assert handle.persisted.result(timeout=30) is not None
        first = scrape(reg)
        time.sleep(1.5)
        second = scrape(reg)
        # read at scrape time: the lag grows while no record arrives
        assert first[("ck_upload_lag_steps", ())] == second[("ck_upload_lag_steps", ())] == 1
        assert second[("ck_upload_lag_seconds", ())] >= first[("ck_upload_lag_seconds", ())] + 1.0
        assert ("ck_last_committed_step", (("tier", "remote"),)) not in second
        assert second[("ck_last_committed_step", (("tier", "local"),))] == 1
        with pytest.raises(UploadError, match="step 1"):
            mgr.wait(timeout=60)
        after = scrape(reg)
        assert after[("ck_upload_failures_total", ())] == 1
        assert after[("ck_saves_total", ())] == 1
        assert after[("ck_save_durable_seconds_count", ())] == 1
        assert after[("ck_save_upload_seconds_count", ())] == 0
        assert after[("ck_remote_consecutive_failures", ())] >= 1
        assert after[("ck_upload_lag_steps", ())] == 1
        assert after[("ck_upload_lag_seconds", ())] > second[("ck_upload_lag_seconds", ())]
    finally:
        with contextlib.suppress(UploadError):
            mgr.close()


def test_manager_argument_attaches_the_hook(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    with CheckpointManager(tmp_path / "c") as mgr:
        metrics = PrometheusMetrics(reg, manager=mgr)
        assert scrape(reg)[("tierckpt_upload_lag_steps", ())] == 0  # no remote: no lag, no remote step
        mgr.save(7, _state(7))
        mgr.wait()
        got = scrape(reg)
    assert metrics.manager is mgr
    assert got[("tierckpt_saves_total", ())] == 1
    assert got[("tierckpt_save_upload_seconds_count", ())] == 0  # no remote tier: nothing uploaded, no failure
    assert got[("tierckpt_upload_failures_total", ())] == 0
    assert got[("tierckpt_last_committed_step", (("tier", "local"),))] == 7
    assert ("tierckpt_last_committed_step", (("tier", "remote"),)) not in got


def test_records_map_to_the_right_counters() -> None:
    reg = CollectorRegistry()
    metrics = PrometheusMetrics(reg)
    metrics(SaveRecord(step=1, bytes=100, stall_s=0.01, persist_s=0.5, upload_skipped="superseded by step 2"))
    metrics(SaveRecord(step=2, bytes=50, stall_s=0.02, error="disk full"))  # the local tier failed
    metrics(SaveRecord(step=3, bytes=10, stall_s=0.03, persist_s=0.2, upload_s=0.9))
    got = scrape(reg)
    assert got[("tierckpt_saves_total", ())] == 3
    assert got[("tierckpt_uploads_skipped_total", ())] == 1
    assert got[("tierckpt_save_failures_total", ())] == 1
    assert got[("tierckpt_upload_failures_total", ())] == 0
    assert got[("tierckpt_saved_bytes_total", ())] == 110  # a failed save wrote nothing
    assert got[("tierckpt_save_stall_seconds_count", ())] == 3
    assert got[("tierckpt_save_durable_seconds_count", ())] == 2
    assert got[("tierckpt_save_durable_seconds_bucket", (("le", "0.25"),))] == 1
    assert got[("tierckpt_save_upload_seconds_count", ())] == 1
    # no manager attached: no tier gauges at all
    assert not any(name.startswith("tierckpt_upload_lag") for name, _ in got)
    metrics.unregister()
    assert scrape(reg) == {}


def test_a_closed_manager_does_not_break_the_scrape(tmp_path: Path) -> None:
    reg = CollectorRegistry()
    metrics = PrometheusMetrics(reg)
    mgr = CheckpointManager(tmp_path / "c", on_record=metrics)
    metrics.attach(mgr)
    mgr.save(1, _state(1))
    mgr.close()
    import shutil

    shutil.rmtree(tmp_path / "c")
    got = scrape(reg)  # whatever health() does now, the counters are still served
    assert got[("tierckpt_saves_total", ())] == 1


def test_importing_without_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    for name in [m for m in sys.modules if m.startswith("prometheus_client.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "tierckpt.metrics")
    with pytest.raises(ImportError, match=r'pip install "tierckpt\[prometheus\]"'):
        importlib.import_module("tierckpt.metrics")
    monkeypatch.undo()
    assert importlib.import_module("tierckpt.metrics").PrometheusMetrics is PrometheusMetrics
