"""Upload throughput of tierckpt's remote tier against a plain copy of the same files.

    python benchmarks/upload.py [--size-gib 0.5] [--repeats 3] [--no-s3] [--out upload.json]

For each remote (a POSIX folder on the same disk, and moto's S3 server on loopback) and each repeat, interleaved:

1. tierckpt saves the benchmark state twice with ``remote=...``; for the second save, ``upload`` is the time from
   local durability (``handle.persisted``) to remote durability (``handle.uploaded``);
2. the committed local step folder that tierckpt just uploaded is copied again by the baseline, right after, with
   the files in the page cache as they were for tierckpt's uploader: POSIX ``shutil.copyfile`` of every file +
   fsync of each and of the folder, one thread; S3 one recursive s3fs ``fs.put``.

Reported: median seconds, GB/s and tierckpt's time over the plain copy's (1.0: as fast as a plain copy; tierckpt
also re-checks the local step and follows the remote commit protocol). Moto keeps the objects in memory and runs
in this process: compare the ratio, not the GB/s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import harness as h

LABELS = {"posix": "POSIX folder", "s3": "S3 (moto, loopback)"}
PLAIN = {"posix": "shutil.copyfile+fsync", "s3": "one s3fs fs.put"}


def plain_copy_posix(src: Path, dst: Path) -> float:
    """Seconds to copy every file of ``src`` into a new folder ``dst`` with ``shutil.copyfile`` + fsync."""
    t0 = time.perf_counter()
    dst.mkdir(parents=True)
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        shutil.copyfile(f, dst / f.name)
        fd = os.open(dst / f.name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    h.fsync_path(dst, folder=False)
    return time.perf_counter() - t0


def one_repeat(tc: Any, state: dict[str, Any], scratch: Path, kind: str, s3: h.S3 | None) -> dict[str, Any]:
    """tierckpt's save and upload of the state, then the plain copy of the same committed files."""
    d = h.fresh_dir(scratch, f"upload-{kind}")
    out: dict[str, Any] = {}
    kwargs: dict[str, Any] = {"keep_remote": 1}
    remote = str(d / "remote")
    if kind == "s3":
        assert s3 is not None
        remote, kwargs["storage_options"] = f"s3://{s3.bucket}/{d.name}/tier", s3.storage_options
    try:
        with tc.CheckpointManager(d / "local", remote=remote, **kwargs) as mgr:
            for step in (1, 2):
                handle = mgr.save(step, state)
                persisted, uploaded = float(handle.persisted.result()), float(handle.uploaded.result())
                mgr.wait()
            out["tierckpt_upload"] = uploaded - persisted
            out["tierckpt_upload_lib"] = getattr(handle.record(), "upload_s", None)
        src = max(p for p in (d / "local").iterdir() if p.is_dir() and p.name.startswith("step-"))
        files = [f for f in src.iterdir() if f.is_file()]
        out["bytes"], out["files"] = sum(f.stat().st_size for f in files), len(files)
        if kind == "posix":
            out["plain_copy"] = plain_copy_posix(src, d / "plain")
        else:
            out["plain_copy"] = h.plain_put_s3(src, f"s3://{s3.bucket}/{d.name}/plain", s3.storage_options)
    finally:
        h.remove(d)
        if s3 is not None and kind == "s3":
            s3.rm(d.name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__)
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-s3", action="store_true", help="skip the S3 loopback remote")
    a = p.parse(argv)
    tc = h.need_tierckpt("upload benchmark")
    scratch = h.scratch_dir(a.dir)
    state = h.gpt_state(int(a.size_gib * h.GiB))
    with contextlib.ExitStack() as stack:
        s3 = None if a.no_s3 else h.try_s3(stack)
        kinds = ["posix"] + (["s3"] if s3 is not None else [])
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for r in range(a.repeats):
            for kind in h.rotate(kinds, r):
                h.settle()
                try:
                    runs[kind].append(one_repeat(tc, state, scratch, kind, s3))
                except Exception as exc:  # reported, not fatal
                    runs[kind].append({"error": f"{type(exc).__name__}: {exc}"})
                h.log(f"{kind} repeat {r + 1}/{a.repeats}")
    heads = ["remote", "files", "GiB", "tierckpt upload s", "GB/s", "plain copy s", "GB/s", "tierckpt / plain"]
    rows, summary = [], {}
    for kind in kinds:
        ok = [m for m in runs[kind] if "error" not in m]
        if not ok:
            summary[kind] = {"error": runs[kind][0]["error"] if runs[kind] else "no runs"}
            rows.append([kind, "ERROR: " + summary[kind]["error"][:80], "", "", "", "", "", ""])
            continue
        nbytes = ok[0]["bytes"]
        tu, pc = h.median([m["tierckpt_upload"] for m in ok]), h.median([m["plain_copy"] for m in ok])
        summary[kind] = {"bytes": nbytes, "files": ok[0]["files"], "tierckpt_upload": tu, "plain_copy": pc,
                         "ratio": h.ratio(tu, pc)}
        rows.append([LABELS[kind], str(ok[0]["files"]), nbytes / h.GiB, tu, h.ratio(nbytes / 1e9, tu), pc,
                     h.ratio(nbytes / 1e9, pc), h.ratio(tu, pc)])
    desc = h.describe(state)
    md = (h.sections([(f"Upload of one committed step ({desc['tensors']} tensors), medians of {a.repeats}", heads,
                       rows)]) + "\nPlain copy: " + "; ".join(f"{k}: {PLAIN[k]}" for k in kinds) + "\n")
    print(md)
    h.finish(a, {"kind": "upload", "machine": h.machine(scratch), "state": desc, "tierckpt_version": tc.__version__,
                 "summary": summary, "runs": runs, "markdown": md}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
