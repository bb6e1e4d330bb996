"""`Knockout`'s repr: short, naming what it knocks out (the dataclass repr printed every position:
2,066 characters for a 400-token needle)."""

from __future__ import annotations

from steer import Knockout


def test_repr_names_the_knocked_out_positions_in_runs():
    k = Knockout(keys=list(range(500, 900)))
    assert (
        repr(k) == "Knockout(keys=[500..899] (400), queries=all, layers=all, heads=all, factor=0 (blocked))"
    )
    scaled = Knockout(keys="span", queries=[-1], layers=range(3, 8), heads=[1, 4], factor=0.5)
    assert repr(scaled) == (
        "Knockout(keys='span', queries=[-1] (1), layers=[3..7] (5), heads=[1, 4] (2), factor=0.5 (x0.5))"
    )
    rows = Knockout(keys=[[1, 2, 3], [7]])
    assert repr(rows).startswith("Knockout(keys=2 rows, row 0 [1..3] (3),")
    sparse = repr(Knockout(keys=list(range(0, 2000, 2))))
    assert len(sparse) < 120 and "996 more runs] (1000)" in sparse


def test_repr_keeps_names_whole():
    """A list of names (refused when the edits are built) prints as given: it was taken for one
    position list per row and split into characters (`2 rows, row 0 ['I', 'O']`: breaker)."""
    r = repr(Knockout(keys=["IO", "S"]))
    assert r.startswith("Knockout(keys=['IO', 'S'], ") and "rows" not in r
