"""The CLI's side-by-side answer tables give both answers the same width."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def test_equal_ratio_columns_need_expand():
    # the tables in viz/cli (generate, demo, vision) use ratio=1 columns with expand=True
    import inspect

    import viz.cli.demo as demo
    import viz.cli.main as main
    import viz.cli.vision as vision

    for mod in (main, demo, vision):
        assert "expand=True" in inspect.getsource(mod), mod.__name__
    table = Table(show_lines=True, expand=True)
    table.add_column("baseline", ratio=1)
    table.add_column("steered", ratio=1)
    table.add_row("short", "a much longer steered answer " * 8)
    console = Console(width=100, record=True)
    console.print(table)
    header = console.export_text().splitlines()[1]
    left, right = header.split("┃")[1:3]
    assert abs(len(left) - len(right)) <= 1
