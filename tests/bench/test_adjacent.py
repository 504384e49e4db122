"""The benchmark's raw read timed next to every cold load (benchmarks/_suite.cold) and its summary (bench.derive).

The benchmark scripts are not a package; these tests put benchmarks/ on the path the way its scripts do.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

bench = pytest.importorskip("bench")
suite = pytest.importorskip("_suite")
limits = pytest.importorskip("limits")


class _Ref:
    """Stands in for RefFiles: logs when it reads, and fills the target the way the real read does."""

    def __init__(self, log: list[str], seconds: float) -> None:
        self.log, self.seconds = log, seconds

    def read(self, ctx: object) -> float:
        self.log.append("ref")
        for t in ctx.dst_list:  # type: ignore[attr-defined]
            t.fill_(7)
        return self.seconds


def _ctx(tmp_path: Path) -> object:
    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10, dtype=torch.bfloat16)}
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    return suite.Ctx(state=state, dst=dst, scratch=tmp_path)


def test_reference_read_alternates_around_the_load_and_never_under_its_check(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    log: list[str] = []
    ctx.ref = _Ref(log, 2.0)
    seen: list[bool] = []
    for _ in range(4):
        out: dict[str, object] = {}
        with suite.cold(ctx, out, "load_cold"):
            log.append("load")
            assert all(int(t.count_nonzero()) == 0 for t in ctx.dst_list)  # cleared after a reference read
            for s, d in zip(ctx.src_list, ctx.dst_list, strict=True):
                d.copy_(s)
            out["load_cold"] = 1.0
            seen.append(ctx.verify())  # the check runs before a reference read may overwrite the target
        assert out["load_cold_ref"] == 2.0
        assert out["load_cold_vs_ref"] == pytest.approx(0.5)
    assert log == ["ref", "load", "load", "ref", "ref", "load", "load", "ref"]
    assert seen == [True] * 4


def test_a_warm_load_follows_its_cold_load_before_any_reference_read(tmp_path: Path) -> None:
    """The reference read drops the page cache; a "warm" load timed after one that follows the cold load would be
    cold again (it was, on every other turn, until this was fixed)."""
    ctx = _ctx(tmp_path)
    log: list[str] = []
    ctx.ref = _Ref(log, 2.0)

    def load() -> None:
        log.append("load")
        for s, d in zip(ctx.src_list, ctx.dst_list, strict=True):
            d.copy_(s)

    for _ in range(2):
        out: dict[str, object] = {}
        ctx.loads = True  # type: ignore[attr-defined]
        suite.timed_loads(ctx, out, load)
        assert "load_cold" in out and "load_warm" in out and out["load_ok"] is True
    assert log == ["ref", "load", "load", "load", "load", "ref"]


def test_without_reference_files_nothing_is_paired(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    out: dict[str, object] = {}
    with suite.cold(ctx, out, "load_cold"):
        out["load_cold"] = 1.0
    assert "load_cold_ref" not in out and "load_cold_vs_ref" not in out


def test_reference_files_read_back_the_state(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    ref = suite.RefFiles.create(ctx)
    try:
        assert sum(p.stat().st_size for p in ref.paths) == sum(t.nbytes for t in ctx.src_list)
        want = [bytes(b) for b in ref.aligned] if ref.aligned is not None else None
        for b in ref.aligned or []:  # the read must fill them again: zeroed, a read that does nothing fails
            b[:] = bytes(len(b))
        assert ref.read(ctx) > 0
        if ref.aligned is not None:  # O_DIRECT into the page-aligned copies, the fastest raw read
            assert [bytes(b) for b in ref.aligned] == want
            packed = b"".join(bytes(ctx.src_list[i].reshape(-1).view(torch.uint8).numpy()) for g in ref.groups
                              for i in g)
            assert b"".join(want) == packed
        else:  # no O_DIRECT here: buffered into the target state
            assert ctx.verify() is True
        seconds = ref.write(ctx)  # None only where the file system refuses O_DIRECT
        assert seconds is None or seconds > 0
        assert sorted(p.name for p in ref.paths[0].parent.iterdir()) == sorted(p.name for p in ref.paths)
    finally:
        ref.remove()
    assert not ref.paths[0].parent.exists()


def test_derive_reports_the_paired_ratios_and_the_adjacent_read(tmp_path: Path) -> None:
    med = {
        "raw": {"read_cold_nf": 1.0, "read_cold_1f": 1.2, "write_nf": 2.0},
        "torch.save": {"load_cold": 3.0, "load_cold_ref": 1.5, "load_cold_vs_ref": 2.0},
        "tierckpt": {"load_cold": 2.0, "load_cold_ref": 1.3, "load_cold_vs_ref": 1.54,
                     "load_cold_inplace": 1.4, "load_cold_inplace_ref": 1.4, "load_cold_inplace_vs_ref": 1.0},
    }  # fmt: skip
    d = bench.derive(med, 1 << 30)
    assert d["limits"]["read_cold"] == 1.0
    assert d["limits"]["read_cold_adjacent"] == 1.4  # the median of 1.5, 1.3 and 1.4; no ratio among them
    assert d["systems"]["tierckpt"]["load_cold_vs_read"] == pytest.approx(2.0)
    assert d["systems"]["tierckpt"]["load_cold_vs_ref"] == 1.54
    assert d["systems"]["tierckpt in_place restore"]["load_cold_vs_ref"] == 1.0
    assert d["systems"]["torch.save"]["load_cold_vs_ref"] == 2.0


def test_restore_pairs_are_pooled_over_repeats_and_summarized() -> None:
    runs = [{"load_cold_inplace_pairs": [(1.0, 1.0), (2.2, 2.0)]}, {"load_cold_inplace_pairs": [(0.9, 1.0)]},
            {"load_cold_inplace_pairs": [(1.5, 1.0), (3.0, 2.0)]}]  # fmt: skip
    med = suite.summarize(runs)
    assert med["load_cold_inplace_pairs"] == [(1.0, 1.0), (2.2, 2.0), (0.9, 1.0), (1.5, 1.0), (3.0, 2.0)]
    p = suite.paired_ratios(med["load_cold_inplace_pairs"])
    assert p is not None
    assert p["n"] == 5 and p["min"] == 0.9 and p["max"] == 1.5
    assert p["median"] == pytest.approx(1.1)  # ratios 0.9, 1.0, 1.1, 1.5, 1.5
    assert (p["q1"], p["q3"]) == (pytest.approx(1.0), pytest.approx(1.5))
    assert suite.paired_ratios([(1.0, None)]) is None and suite.paired_ratios(None) is None
    d = bench.derive({"raw": {"read_cold_nf": 1.0},
                      "tierckpt": {"load_cold_inplace": 1.3, "load_cold_inplace_vs_ref": 1.3, **med}},
                     1 << 30)  # fmt: skip
    assert d["systems"]["tierckpt in_place restore"]["load_cold_vs_ref"] == pytest.approx(1.1)  # pooled, not 1.3
    assert d["inplace_pairs"]["n"] == 5


def test_derive_pools_the_saves_next_to_their_write_limit() -> None:
    med = {"raw": {"write_nf_direct": 1.0},
           "tierckpt": suite.summarize([{"durable": 1.3, "durable_pairs": [(1.3, 1.0), (1.2, 1.2)]},
                                        {"durable": 1.1, "durable_pairs": [(1.1, 1.1)]}]),
           "tierckpt copy-first": {"durable": 1.2}}  # fmt: skip
    d = bench.derive(med, 1 << 30)
    t = d["systems"]["tierckpt"]
    assert t["durable_vs_write"] == pytest.approx(1.2)  # the median of the repeats' durable times over the limit
    assert t["durable_vs_ref"] == pytest.approx(1.0) and t["durable_pairs"]["n"] == 3  # ratios 1.3, 1.0, 1.0
    assert d["systems"]["tierckpt copy-first"]["durable_vs_ref"] is None
    assert d["limits"]["write_adjacent"] == pytest.approx(1.1)


@pytest.mark.parametrize("repeat", [0, 1])
def test_memcpy_limit_times_copy_and_the_streaming_copy_into_the_targets(tmp_path: Path, repeat: int) -> None:
    from tierckpt.snapshot import hostcopy

    ctx = _ctx(tmp_path)
    ctx.repeat = repeat  # type: ignore[attr-defined]
    out = limits.case_memcpy(ctx)
    assert out["time"] > 0
    assert ("time_stream" in out) is hostcopy.available
    for k, v in ctx.state.items():  # type: ignore[attr-defined]
        assert torch.equal(ctx.dst[k], v), k  # type: ignore[attr-defined]
    d = bench.derive({"memcpy": {"time": 2.0, "time_stream": 1.0}, "tierckpt": {"stall": 1.5}}, 1 << 30)
    assert d["limits"]["memcpy_stream"] == 1.0
    assert d["systems"]["tierckpt"]["stall_vs_memcpy"] == pytest.approx(0.75)
    assert d["systems"]["tierckpt"]["stall_vs_stream"] == pytest.approx(1.5)


def test_suites_run_interleaved_with_rotating_order(tmp_path: Path) -> None:
    """The count sweep's suites alternate within every repeat (not all of one, then all of the other), and the
    order of the suites and of their cases rotates, so that neither always runs first."""
    calls: list[tuple[str, str, int]] = []

    def case(suite: str, name: str):  # type: ignore[no-untyped-def]
        def run(ctx: object) -> dict[str, float]:
            calls.append((suite, name, ctx.repeat))  # type: ignore[attr-defined]
            return {"time": float(len(calls))}

        return run

    suites = [(f"[{s}] ", _ctx(tmp_path), {n: case(s, n) for n in ("x", "y")}) for s in ("A", "B")]
    out = suite.run_suites(suites, 2)
    assert calls == [("A", "x", 0), ("A", "y", 0), ("B", "x", 0), ("B", "y", 0),
                     ("B", "y", 1), ("B", "x", 1), ("A", "y", 1), ("A", "x", 1)]  # fmt: skip
    # each suite's medians come from its own runs only (A's x ran 1st and 8th: median 4.5)
    assert out[0]["medians"]["x"]["time"] == 4.5
    assert out[1]["medians"]["y"]["time"] == 4.5
    assert [len(r) for r in out[0]["runs"].values()] == [2, 2]
