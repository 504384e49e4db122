"""Restore from object storage: ranged reads in flight per file (``remote_read_concurrency``) against plain GETs.

    python benchmarks/remote_restore.py [--size-gib 0.25] [--repeats 3] [--latency-ms 0,25] [--concurrency 1,8]
                                        [--file-size-mb 32] [--list-steps N] [--out remote_restore.json]

The state is saved once to moto's S3 server on loopback (in a process of its own, so that its request handling does
not share this process's GIL). Then, for each repeat and each emulated round trip, interleaved:

- ``tierckpt rc=N``: a manager with an empty local tier restores the step from the remote (verifying every byte)
  with ``remote_read_concurrency=N``;
- ``plain GET``: the same objects fetched whole with s3fs ``cat_file``, two at a time (the manager's reader count),
  hashing nothing: the naive download.

With ``--list-steps N``, N small steps are saved to another prefix and listing them as ``mgr.steps()`` and
``tierckpt ls`` do (an existence check and a manifest read per step) is timed for each concurrency too.

Loopback answers at once, unlike S3 (15-30 ms to a first byte in a region): ``--latency-ms`` emulates that round
trip, a wrapper around the real s3fs filesystem sleeping before every GET, HEAD and LIST (the bytes still come from
moto). Moto reads a whole object for every ranged GET (S3 does not), hence files of 32 MiB rather than the default
512 MiB. Reported: median seconds, GB/s and ratios to the first concurrency and to the plain GET.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import harness as h
import torch


class _LatencyFS:
    """The real s3fs filesystem; every request a reader makes (``cat_file``: a GET; ``exists``, ``info``, ``size``: a
    HEAD; ``ls``: a LIST) first waits an emulated round trip."""

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


def restore_once(tc: Any, scratch: Path, url: str, opts: dict[str, Any], dst: Any, rc: int, latency_s: float) -> float:
    """Seconds of one verified restore of step 1 from the remote into ``dst``, by a manager with an empty local tier."""
    d = h.fresh_dir(scratch, "rr-local")
    try:
        with tc.CheckpointManager(d, remote=url, storage_options=opts, remote_read_concurrency=rc) as mgr:
            mgr.remote.fs = _LatencyFS(mgr.remote.fs, latency_s)
            t0 = time.perf_counter()
            step = mgr.restore(dst, source="remote")
            elapsed = time.perf_counter() - t0
    finally:
        h.remove(d)
    if step != 1:
        raise RuntimeError(f"restored step {step}, expected 1")
    return elapsed


def list_once(scratch: Path, url: str, opts: dict[str, Any], rc: int, latency_s: float, n: int) -> float:
    """Seconds to list the ``n`` remote steps at ``url`` as ``mgr.steps()`` does."""
    from tierckpt.status import list_steps
    from tierckpt.storage.local import LocalStore
    from tierckpt.storage.open import open_store

    remote = open_store(url, storage_options=opts, tier="remote", create=False, read_concurrency=rc)
    remote.fs = _LatencyFS(remote.fs, latency_s)
    d = h.fresh_dir(scratch, "rr-list")
    try:
        t0 = time.perf_counter()
        infos = list_steps(LocalStore(d), remote, set(), set())
        elapsed = time.perf_counter() - t0
    finally:
        h.remove(d)
        remote.close()
    if len(infos) != n or any(i.state != "remote" for i in infos):
        raise RuntimeError(f"listed {len(infos)} steps, expected {n} remote ones")
    return elapsed


def plain_get(url: str, opts: dict[str, Any], latency_s: float) -> float:
    """Seconds to fetch every data object of step 1 whole, two at a time."""
    import s3fs

    fs = _LatencyFS(s3fs.S3FileSystem(**opts, skip_instance_cache=True), latency_s)
    names = [p for p in fs.ls(url.removeprefix("s3://") + "/step-0000000001") if p.endswith(".safetensors")]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as ex:
        total = sum(map(len, ex.map(fs.cat_file, names)))
    elapsed = time.perf_counter() - t0
    if not total:
        raise RuntimeError("no data objects found")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__)
    p.add_argument("--size-gib", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-ms", default="0,25", help="emulated round trips to measure, comma-separated")
    p.add_argument("--concurrency", default="1,8", help="remote_read_concurrency values, comma-separated")
    p.add_argument("--list-steps", type=int, default=0, metavar="N", help="also time listing N remote steps")
    p.add_argument("--file-size-mb", type=int, default=32,
                   help="data file size (moto copies a whole object for every ranged GET, S3 does not)")
    a = p.parse(argv)
    tc = h.need_tierckpt("remote restore benchmark")
    latencies = [float(x) / 1e3 for x in a.latency_ms.split(",") if x.strip()]
    rcs = [int(x) for x in a.concurrency.split(",") if x.strip()]
    scratch = h.scratch_dir(a.dir)
    state = h.gpt_state(int(a.size_gib * h.GiB))
    dst, nbytes = h.empty_like_state(state), h.state_bytes(state)
    cases = [f"tierckpt rc={rc}" for rc in rcs] + ["plain GET"]
    lists = [f"list {a.list_steps} steps rc={rc}" for rc in rcs] if a.list_steps else []
    times: dict[tuple[float, str], list[float]] = {(lat, c): [] for lat in latencies for c in cases + lists}
    with h.s3_server(own_process=True) as s3:
        opts = s3.storage_options
        url, list_url = f"s3://{s3.bucket}/remote-restore", f"s3://{s3.bucket}/remote-list"
        d = h.fresh_dir(scratch, "rr-save")
        try:
            with tc.CheckpointManager(d, remote=url, storage_options=opts, file_size_mb=a.file_size_mb) as mgr:
                mgr.save(1, state)
                mgr.wait()
            if a.list_steps:
                with tc.CheckpointManager(d / "many", remote=list_url, storage_options=opts, keep_local=1) as mgr:
                    for step in range(1, a.list_steps + 1):
                        mgr.save(step, {"x": torch.full((16,), float(step))})
                    mgr.wait()
        finally:
            h.remove(d)
        for r in range(a.repeats):
            for lat in latencies:
                for case in (lists if r % 2 == 0 else lists[::-1]) + h.rotate(cases, r):
                    h.settle()
                    if case.startswith("list"):
                        t = list_once(scratch, list_url, opts, int(case.split("=")[1]), lat, a.list_steps)
                    elif case == "plain GET":
                        t = plain_get(url, opts, lat)
                    else:
                        t = restore_once(tc, scratch, url, opts, dst, int(case.split("=")[1]), lat)
                    times[(lat, case)].append(t)
                    h.log(f"repeat {r + 1}/{a.repeats} latency {lat * 1e3:.0f} ms {case}: {t:.3f} s")
    if not h.states_equal(dst, state):
        raise RuntimeError("the restored state differs from the saved one")
    heads = ["emulated round trip", "case", "median s", "GB/s", "vs rc=1", "vs plain GET"]
    rows: list[list[str]] = []
    summary: dict[str, Any] = {}
    for lat in latencies:
        rows += h.case_rows(f"{lat * 1e3:.0f}ms", {c: times[(lat, c)] for c in cases}, cases[0], "plain GET",
                            nbytes, summary)  # summary keys as "25ms tierckpt rc=8": the docs read them
    for lat in latencies:
        base = h.median(times[(lat, lists[0])]) if lists else None
        for case in lists:
            m = h.median(times[(lat, case)])
            rows.append([f"{lat * 1e3:.0f}ms", case, f"{m:.3f}", "", f"{h.ratio(m, base):.2f}x", ""])
            summary[f"{lat * 1e3:.0f}ms {case}"] = {"median_s": m, "all_s": times[(lat, case)]}
    md = h.markdown_table(heads, rows)
    print(md)
    h.finish(a, {"kind": "remote_restore", "bytes": nbytes, "results": summary, "machine": h.machine(scratch),
                 "tierckpt_version": tc.__version__, "markdown": md}, md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
