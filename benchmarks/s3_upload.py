"""Uploads to S3 with parts in flight (``remote_write_concurrency``) against one part at a time and a plain put.

    python benchmarks/s3_upload.py [--size-gib 0.25] [--repeats 3] [--concurrency 1,4] [--part-mb 64]
                                   [--emulate 0:0,25:100] [--out s3_upload.json] [--markdown s3_upload.md]

A committed local step of the benchmark state is replicated to moto's S3 server on loopback (in a process of its
own) with the uploader's own call (``replicate_step``, what the manager runs after each save: it re-hashes the
local files while it sends them and commits the remote step manifest last), once per part size and write
concurrency, and, as the peer, copied with one plain recursive s3fs ``fs.put`` (up to 10 parts of a file at once,
nothing checked). Cases are interleaved, each into a fresh prefix.

Loopback has no round trip and no per-connection limit, unlike S3, where one connection gets a fraction of a node's
bandwidth. ``--emulate RTT_MS:MBPS`` adds both: every S3 request of this process first waits ``RTT_MS``, and a part
or object upload ends no sooner than ``MBPS`` megabytes a second on one connection would take to send it (an
``asyncio.sleep`` inside s3fs's request call, beside the real request: requests in flight overlap as real ones
would, and moto's own work on a body overlaps its emulated transfer, as S3's does). ``0:0`` is loopback as it is.
Reported: median seconds, GB/s and ratios to the first case and to the plain put.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import harness as h

#: (round trip s, bytes/s per connection) in force for this process's S3 requests; (0, 0): none
_EMULATED: list[tuple[float, float]] = [(0.0, 0.0)]


def _emulate_requests() -> None:
    """Make every s3fs request (the async ``_call_s3`` and its sync twin ``call_s3``) wait as ``_EMULATED`` says."""
    import s3fs
    from fsspec.asyn import sync_wrapper

    real = s3fs.S3FileSystem._call_s3

    async def call(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        rtt, bps = _EMULATED[0]
        body = kwargs.get("Body")
        send = len(body) / bps if bps and isinstance(body, (bytes, bytearray, memoryview)) else 0.0
        if rtt:
            await asyncio.sleep(rtt)
        if not send:
            return await real(self, method, *args, **kwargs)
        # S3 takes a body in while it arrives, moto parses it once whole: the request ends with the slower of the two
        _, reply = await asyncio.gather(asyncio.sleep(send), real(self, method, *args, **kwargs))
        return reply

    s3fs.S3FileSystem._call_s3 = call  # type: ignore[method-assign]
    s3fs.S3FileSystem.call_s3 = sync_wrapper(call)  # type: ignore[method-assign]


def upload_once(local: Any, step: int, url: str, opts: dict[str, Any], wc: int, part: int) -> float:
    """Seconds of one ``replicate_step`` of ``step`` to ``url`` with ``wc`` parts of ``part`` bytes in flight."""
    from tierckpt.storage.open import open_store
    from tierckpt.tiers.uploader import replicate_step

    remote = open_store(url, storage_options=opts, tier="remote", part_size=part, write_concurrency=wc)
    try:
        t0 = time.perf_counter()
        replicate_step(local, remote, step, threads=4, part_size=part)
        return time.perf_counter() - t0
    finally:
        remote.close()


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__)
    p.add_argument("--size-gib", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", default="1,4", help="remote_write_concurrency values, comma-separated")
    p.add_argument("--emulate", default="0:0,25:100", help="RTT_MS:MBPS per connection, comma-separated")
    p.add_argument("--part-mb", default="64", help="part sizes in MiB (the manager's upload_part_mb), comma-separated")
    a = p.parse(argv)
    tc = h.need_tierckpt("s3 upload benchmark")
    from tierckpt.format import layout
    from tierckpt.storage.local import LocalStore

    emulations = [(float(r) / 1e3, float(m) * 1e6) for r, m in (x.split(":") for x in a.emulate.split(",") if x)]
    wcs, parts = ([int(x) for x in v.split(",") if x.strip()] for v in (a.concurrency, a.part_mb))
    scratch = h.scratch_dir(a.dir)
    state = h.gpt_state(int(a.size_gib * h.GiB))
    nbytes = h.state_bytes(state)
    settings = {(f"tierckpt wc={wc}" if len(parts) == 1 else f"tierckpt {mb} MiB wc={wc}"): (mb, wc)
                for mb in parts for wc in wcs}
    cases = [*settings, "plain fs.put"]
    times: dict[tuple[tuple[float, float], str], list[float]] = {(e, c): [] for e in emulations for c in cases}
    d = h.fresh_dir(scratch, "s3up-local")
    _emulate_requests()
    try:
        with tc.CheckpointManager(d) as mgr:
            mgr.save(1, state)
        del state
        local, folder, n = LocalStore(d, tier="local"), d / layout.step_dir(1), 0
        with h.s3_server(own_process=True) as s3:
            for r in range(a.repeats):
                for emu in emulations:
                    _EMULATED[0] = emu
                    for case in h.rotate(cases, r):
                        h.settle()
                        n += 1
                        url = f"s3://{s3.bucket}/up{n}"
                        if case == "plain fs.put":
                            t = h.plain_put_s3(folder, url, s3.storage_options)
                        else:
                            mb, wc = settings[case]
                            t = upload_once(local, 1, url, s3.storage_options, wc, mb << 20)
                        times[(emu, case)].append(t)
                        h.log(f"repeat {r + 1}/{a.repeats} emulate {emu[0] * 1e3:.0f} ms {emu[1] / 1e6:.0f} MB/s "
                              f"{case}: {t:.3f} s")
            _EMULATED[0] = (0.0, 0.0)
    finally:
        h.remove(d)
    heads = ["emulated round trip, per-connection MB/s", "case", "median s", "GB/s", f"vs {cases[0]}",
             "vs plain fs.put"]
    rows: list[list[str]] = []
    summary: dict[str, Any] = {}
    for emu in emulations:
        label = "none (loopback)" if emu == (0.0, 0.0) else f"{emu[0] * 1e3:.0f} ms, {emu[1] / 1e6:.0f} MB/s"
        rows += h.case_rows(label, {c: times[(emu, c)] for c in cases}, cases[0], "plain fs.put", nbytes, summary)
    md = h.markdown_table(heads, rows)
    print(md)
    h.finish(a, {"kind": "s3_upload", "bytes": nbytes, "results": summary, "machine": h.machine(scratch),
                 "tierckpt_version": tc.__version__, "markdown": md}, md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
