"""Upload throughput of tierckpt's remote tier against a plain copy of the same files.

    python benchmarks/upload.py [--size-gib 0.5] [--repeats 3] [--no-s3] [--out upload.json]

For each remote (a POSIX folder on the same disk, and moto's S3 server on loopback) and each repeat:

1. tierckpt saves the benchmark state twice with ``remote=...``; for the second save, ``upload`` is the time from
   local durability (``handle.persisted``) to remote durability (``handle.uploaded``).
2. The committed local step folder that tierckpt just uploaded is copied again by the baseline:
   POSIX: ``shutil.copyfile`` of every file + fsync of each file and the folder, one thread;
   S3: one ``fs.put(folder, url, recursive=True)`` with s3fs.
   Both run right after the save, with the files in the page cache as they were for tierckpt's uploader.

Reported: median seconds, GB/s and tierckpt's time as a ratio to the plain copy (1.0 = as fast as a plain copy;
tierckpt also re-checks the local step, follows the remote commit protocol and, if asked, verifies the upload).
Skips cleanly when tierckpt (or its remote tier) is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    GiB,
    add_output_args,
    fresh_dir,
    fsync_dir,
    import_tierckpt,
    machine_description,
    markdown_table,
    median,
    plain_put_s3,
    ratio,
    remove,
    s3_loopback,
    scratch_dir,
    settle,
    table,
    tierckpt_version,
    write_json,
)
from state import describe, gpt_state


def step_folder(local: Path) -> Path:
    """The newest committed step folder in a local tier root."""
    steps = sorted(p for p in local.iterdir() if p.is_dir() and p.name.startswith("step-"))
    if not steps:
        raise FileNotFoundError(f"no committed step under {local}")
    return steps[-1]


def plain_copy_posix(src: Path, dst: Path) -> float:
    """Copy every file of ``src`` into a new folder ``dst`` with ``shutil.copyfile`` + fsync; seconds."""
    t0 = time.perf_counter()
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            target = dst / f.name
            shutil.copyfile(f, target)
            fd = os.open(target, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(dst)
    return time.perf_counter() - t0


def one_repeat(
    tc: Any, state: dict[str, Any], scratch: Path, kind: str, s3: dict[str, Any] | None
) -> dict[str, Any]:
    """tierckpt save+upload of the state, then the plain copy of the same committed files."""
    d = fresh_dir(scratch, f"upload-{kind}")
    out: dict[str, Any] = {}
    try:
        kwargs: dict[str, Any] = {"keep_remote": 1}
        if kind == "posix":
            remote = str(d / "remote")
        else:
            assert s3 is not None
            remote = f"s3://{s3['bucket']}/{d.name}/tier"
            kwargs["storage_options"] = s3["storage_options"]
        mgr = tc.CheckpointManager(d / "local", remote=remote, **kwargs)
        try:
            for step in (1, 2):
                h = mgr.save(step, state)
                persisted = float(h.persisted.result())
                uploaded = float(h.uploaded.result())
                mgr.wait()
            out["tierckpt_upload"] = uploaded - persisted
            rec = h.record()
            out["tierckpt_upload_lib"] = getattr(rec, "upload_s", None)
        finally:
            mgr.close()
        src = step_folder(d / "local")
        out["bytes"] = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
        out["files"] = sum(1 for f in src.iterdir() if f.is_file())
        if kind == "posix":
            out["plain_copy"] = plain_copy_posix(src, d / "plain")
        else:
            assert s3 is not None
            out["plain_copy"] = plain_put_s3(
                src, f"s3://{s3['bucket']}/{d.name}/plain", s3["storage_options"]
            )
    finally:
        remove(d)
        if kind == "s3" and s3 is not None:
            import s3fs

            fs = s3fs.S3FileSystem(**s3["storage_options"], skip_instance_cache=True)
            if fs.exists(f"{s3['bucket']}/{d.name}"):
                fs.rm(f"{s3['bucket']}/{d.name}", recursive=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-s3", action="store_true", help="skip the S3 loopback remote")
    add_output_args(p)
    a = p.parse_args(argv)
    tc, why = import_tierckpt()
    if tc is None:
        print(f"upload benchmark skipped: {why}")
        return 0
    scratch = scratch_dir(a.dir)
    state = gpt_state(int(a.size_gib * GiB))
    desc = describe(state)
    kinds = ["posix"] if a.no_s3 else ["posix", "s3"]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    s3cm = None
    s3: dict[str, Any] | None = None
    if "s3" in kinds:
        try:
            s3cm = s3_loopback()
            s3 = s3cm.__enter__()
        except Exception as exc:
            print(f"note: S3 loopback unavailable ({type(exc).__name__}: {exc}); S3 skipped")
            kinds.remove("s3")
            runs.pop("s3")
    try:
        for r in range(a.repeats):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                settle()
                try:
                    runs[kind].append(one_repeat(tc, state, scratch, kind, s3))
                except Exception as exc:  # e.g. no remote tier yet: reported, not fatal
                    runs[kind].append({"error": f"{type(exc).__name__}: {exc}"})
                print(
                    f"[{time.strftime('%H:%M:%S')}] {kind} repeat {r + 1}/{a.repeats}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if s3cm is not None:
            s3cm.__exit__(None, None, None)

    heads = [
        "remote",
        "files",
        "GiB",
        "tierckpt upload s",
        "GB/s",
        "plain copy s",
        "GB/s",
        "tierckpt / plain",
    ]
    rows = []
    summary: dict[str, Any] = {}
    for kind in kinds:
        ok = [m for m in runs[kind] if "error" not in m]
        if not ok:
            err = runs[kind][0]["error"] if runs[kind] else "no runs"
            rows.append([kind, "ERROR: " + err[:80], "", "", "", "", "", ""])
            summary[kind] = {"error": err}
            continue
        nbytes = ok[0]["bytes"]
        tu = median([m["tierckpt_upload"] for m in ok])
        pc = median([m["plain_copy"] for m in ok])
        summary[kind] = {"bytes": nbytes, "files": ok[0]["files"], "tierckpt_upload": tu, "plain_copy": pc,
                         "ratio": ratio(tu, pc)}  # fmt: skip
        label = {"posix": "POSIX folder", "s3": "S3 (moto, loopback)"}[kind]
        rows.append([label, str(ok[0]["files"]), nbytes / GiB, tu, nbytes / tu / 1e9 if tu else None, pc,
                     nbytes / pc / 1e9 if pc else None, ratio(tu, pc)])  # fmt: skip
    plain = {"posix": "shutil.copyfile+fsync", "s3": "one s3fs fs.put"}
    title = f"Upload of one committed step ({desc['tensors']} tensors), medians of {a.repeats}"
    print(f"\n== {title} ==\n" + table(heads, rows))
    print("plain copy: " + "; ".join(f"{k}: {plain[k]}" for k in kinds))
    md = (
        f"#### {title}\n\n{markdown_table(heads, rows)}\n\nPlain copy: "
        + "; ".join(f"{k}: {plain[k]}" for k in kinds)
        + "\n"
    )
    if a.out:
        write_json(a.out, {"kind": "upload", "machine": machine_description(scratch), "state": desc,
                           "tierckpt_version": tierckpt_version(tc), "summary": summary, "runs": runs,
                           "markdown": md})  # fmt: skip
    if a.markdown:
        Path(a.markdown).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
