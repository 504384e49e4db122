"""benchmarks/reshard_index.py on small world sizes: for an FSDP step and one of FSDP2 over tensor parallelism, the
ranks found through the shard index are those found from ``manifest.json`` (the script asserts it), a rank reads
less of the index than of ``manifest.json`` once the job has hundreds of ranks, and what it reads of the index
does not grow with the world size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its scripts import harness.py there

import reshard_index  # noqa: E402


@pytest.mark.parametrize("tp", [1, 4])
def test_the_index_finds_the_same_ranks_and_reads_a_constant_amount(tp: int, tmp_path: Path) -> None:
    small, large = (reshard_index.one_world(w, 3, 2, tmp_path, tp) for w in (256, 1024))
    for run in (small, large):
        assert run["tp"] == tp and run["after"]["ranks"] == 2  # 128 restored rows meet two saved shards of 64
        assert run["after"]["bytes"] < run["before"]["bytes"] == run["manifest_bytes"]
        assert run["after"]["requests"] <= 2
    assert large["manifest_bytes"] > 3 * small["manifest_bytes"]
    assert large["after"]["bytes"] == small["after"]["bytes"]
    if tp > 1:
        assert large["placements"] == [f"_S(0, {tp})", "S(0)"]
