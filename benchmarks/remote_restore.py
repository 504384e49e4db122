"""Restore from object storage: ranged reads in flight per file (``remote_read_concurrency``) against plain GETs.

    python benchmarks/remote_restore.py [--size-gib 0.25] [--repeats 3] [--latency-ms 0,25] [--concurrency 1,8]
                                        [--out remote_restore.json] [--markdown remote_restore.md]

The state is saved once to moto's S3 server on loopback (a real S3 endpoint behind s3fs). Then, for each repeat
and each emulated round trip, interleaved:

- ``tierckpt rc=N``: a manager with an empty local tier restores the step from the remote tier (verifying every
  byte) with ``remote_read_concurrency=N``;
- ``plain GET``: the same objects fetched whole with s3fs ``cat_file``, two at a time (the manager's reader count),
  hashing nothing: the naive download.

With ``--list-steps N``, N small steps are saved to another prefix and listing them the way ``mgr.steps()`` and
``tierckpt ls`` do (one existence check and one manifest read per step) is timed for each concurrency too.

Loopback answers at once, unlike S3 (15-30 ms to the first byte in a region). ``--latency-ms`` emulates that round
trip: every GET, HEAD and LIST first sleeps that long (a wrapper around the real s3fs filesystem; the bytes still
travel through moto). Reported: median seconds, GB/s and ratios to ``rc=1`` and to the plain GET.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from common import (
    GiB,
    add_output_args,
    case_rows,
    emit_table,
    fresh_dir,
    import_tierckpt,
    markdown_table,
    median,
    ratio,
    remove,
    s3_loopback,
    scratch_dir,
    settle,
)
from state import empty_like_state, gpt_state, state_bytes, tensors


class _LatencyFS:
    """The real s3fs filesystem; every request a reader makes (``cat_file``: a GET; ``exists``, ``info``, ``size``:
    a HEAD; ``ls``: a LIST) first waits an emulated round trip."""

    REQUESTS = frozenset({"cat_file", "exists", "info", "size", "ls"})

    def __init__(self, fs: Any, latency_s: float) -> None:
        self._fs, self._latency = fs, latency_s

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if name not in self.REQUESTS or not self._latency:
            return attr

        def request(*args: Any, **kwargs: Any) -> Any:
            time.sleep(self._latency)
            return attr(*args, **kwargs)

        return request


def restore_once(tc: Any, scratch: Path, url: str, opts: dict[str, Any], state: Any, dst: Any, rc: int,
                 latency_s: float) -> float:
    d = fresh_dir(scratch, "rr-local")
    try:
        with tc.CheckpointManager(d, remote=url, storage_options=opts, remote_read_concurrency=rc) as mgr:
            mgr.remote.fs = _LatencyFS(mgr.remote.fs, latency_s)
            t0 = time.perf_counter()
            step = mgr.restore(dst, source="remote")
            elapsed = time.perf_counter() - t0
        if step != 1:
            raise RuntimeError(f"restored step {step}, expected 1")
        return elapsed
    finally:
        remove(d)


def list_once(tc: Any, scratch: Path, url: str, opts: dict[str, Any], rc: int, latency_s: float, n: int) -> float:
    from tierckpt.status import list_steps
    from tierckpt.storage.local import LocalStore
    from tierckpt.storage.open import open_store

    remote = open_store(url, storage_options=opts, tier="remote", create=False, read_concurrency=rc)
    remote.fs = _LatencyFS(remote.fs, latency_s)
    d = fresh_dir(scratch, "rr-list")
    try:
        t0 = time.perf_counter()
        infos = list_steps(LocalStore(d), remote, set(), set())
        elapsed = time.perf_counter() - t0
    finally:
        remove(d)
        remote.close()
    if len(infos) != n or any(i.state != "remote" for i in infos):
        raise RuntimeError(f"listed {len(infos)} steps, expected {n} remote ones")
    return elapsed


def plain_get(url: str, opts: dict[str, Any], latency_s: float) -> float:
    import s3fs

    fs = _LatencyFS(s3fs.S3FileSystem(**opts, skip_instance_cache=True), latency_s)
    root = url.removeprefix("s3://") + "/step-0000000001"
    names = [p for p in fs.ls(root) if p.endswith(".safetensors")]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as ex:
        total = sum(map(len, ex.map(fs.cat_file, names)))
    elapsed = time.perf_counter() - t0
    if not total:
        raise RuntimeError("no data objects found")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-ms", default="0,25", help="emulated round trips to measure, comma-separated")
    p.add_argument("--concurrency", default="1,8", help="remote_read_concurrency values, comma-separated")
    p.add_argument("--list-steps", type=int, default=0, metavar="N", help="also time listing N remote steps")
    p.add_argument("--file-size-mb", type=int, default=32,
                   help="data file size (moto copies a whole object for every ranged GET, S3 does not)")
    add_output_args(p)
    a = p.parse_args(argv)
    tc, why = import_tierckpt()
    if tc is None:
        print(f"remote restore benchmark skipped: {why}")
        return 0
    latencies = [float(x) / 1e3 for x in a.latency_ms.split(",") if x.strip()]
    rcs = [int(x) for x in a.concurrency.split(",") if x.strip()]
    scratch = scratch_dir(a.dir)
    state = gpt_state(int(a.size_gib * GiB))
    dst = empty_like_state(state)
    nbytes = state_bytes(state)
    cases = [f"tierckpt rc={rc}" for rc in rcs] + ["plain GET"]
    times: dict[tuple[float, str], list[float]] = {(lat, c): [] for lat in latencies for c in cases}
    with s3_loopback(own_process=True) as s3:
        url, opts = f"s3://{s3['bucket']}/remote-restore", s3["storage_options"]
        d = fresh_dir(scratch, "rr-save")
        try:
            with tc.CheckpointManager(d, remote=url, storage_options=opts, file_size_mb=a.file_size_mb) as mgr:
                mgr.save(1, state)
                mgr.wait()
        finally:
            remove(d)
        list_url = f"s3://{s3['bucket']}/remote-list"
        if a.list_steps:
            d = fresh_dir(scratch, "rr-save-many")
            try:
                with tc.CheckpointManager(d, remote=list_url, storage_options=opts, keep_local=1) as mgr:
                    for step in range(1, a.list_steps + 1):
                        mgr.save(step, {"x": torch.full((16,), float(step))})
                    mgr.wait()
            finally:
                remove(d)
            for lat in latencies:
                for rc in rcs:
                    times[(lat, f"list {a.list_steps} steps rc={rc}")] = []
        for r in range(a.repeats):
            for lat in latencies:
                if a.list_steps:
                    for rc in (rcs if r % 2 == 0 else rcs[::-1]):
                        t = list_once(tc, scratch, list_url, opts, rc, lat, a.list_steps)
                        times[(lat, f"list {a.list_steps} steps rc={rc}")].append(t)
                        print(f"[{time.strftime('%H:%M:%S')}] repeat {r + 1}/{a.repeats} latency {lat * 1e3:.0f} ms "
                              f"list rc={rc}: {t:.3f} s", file=sys.stderr, flush=True)
                order = cases[r % len(cases):] + cases[: r % len(cases)]
                for case in order:
                    settle()
                    if case == "plain GET":
                        t = plain_get(url, opts, lat)
                    else:
                        t = restore_once(tc, scratch, url, opts, state, dst, int(case.split("=")[1]), lat)
                    times[(lat, case)].append(t)
                    print(f"[{time.strftime('%H:%M:%S')}] repeat {r + 1}/{a.repeats} latency {lat * 1e3:.0f} ms "
                          f"{case}: {t:.3f} s", file=sys.stderr, flush=True)
    if not all(map(torch.equal, tensors(dst), tensors(state))):
        raise RuntimeError("the restored state differs from the saved one")
    heads = ["emulated round trip", "case", "median s", "GB/s", "vs rc=1", "vs plain GET"]
    rows: list[list[str]] = []
    summary: dict[str, Any] = {}
    for lat in latencies:
        rows += case_rows(f"{lat * 1e3:.0f} ms", {c: times[(lat, c)] for c in cases}, f"tierckpt rc={rcs[0]}",
                          "plain GET", nbytes, summary)
    if a.list_steps:
        for lat in latencies:
            base = median(times[(lat, f"list {a.list_steps} steps rc={rcs[0]}")])
            for rc in rcs:
                case = f"list {a.list_steps} steps rc={rc}"
                m = median(times[(lat, case)])
                rows.append([f"{lat * 1e3:.0f} ms", case, f"{m:.3f}", "", f"{ratio(m, base):.2f}x", ""])
                summary[f"{lat * 1e3:.0f}ms {case}"] = {"median_s": m, "all_s": times[(lat, case)]}
    emit_table(a, "remote_restore", markdown_table(heads, rows), scratch, tc, bytes=nbytes, results=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
