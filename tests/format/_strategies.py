"""Hypothesis strategies shared by the shard-box tests."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def placed(draw: st.DrawFn) -> tuple[list[int], list[str], list[int]]:
    """A global shape of 1-3 dimensions (sizes 0-13), a mesh of 1-3 dimensions (sizes 1-5) and a placement per
    mesh dimension (``R``, ``S(d)`` or ``_S(d, f)``, FSDP2's strided shard over tensor parallelism)."""
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim))
    mdims = draw(st.integers(1, 3))
    mesh = draw(st.lists(st.integers(1, 5), min_size=mdims, max_size=mdims))
    dims = st.integers(0, ndim - 1)
    places = draw(st.lists(st.one_of(st.just("R"), dims.map(lambda d: f"S({d})"),
                                     st.tuples(dims, st.integers(1, 4)).map(lambda df: f"_S({df[0]}, {df[1]})")),
                           min_size=mdims, max_size=mdims))
    return shape, places, mesh
