"""The CLI's plain progress line estimates the ETA from the steps after the first (the first
one carries a one-off cost such as the prefill)."""

from __future__ import annotations

import re


def test_eta_ignores_the_first_step(monkeypatch, capsys):
    import viz.cli.common as cc

    clock = {"t": 0.0}
    monkeypatch.setattr(cc.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(cc, "PLAIN_PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(type(cc.err), "is_terminal", property(lambda self: False))
    with cc.Run().progress(96, "tokens") as step:
        clock["t"] = 9.0  # the prefill and the first token
        step(1, 96)
        clock["t"] = 9.5  # then 0.5 s per token
        step(2, 96)
        clock["t"] = 10.5
        step(4, 96)
    lines = capsys.readouterr().err.strip().splitlines()
    assert "ETA" not in lines[1]
    eta = [float(m) for m in re.findall(r"ETA (\d+) s", "\n".join(lines))]
    assert eta == [47.0, 46.0]  # 0.5 s x 94 and 0.5 s x 92 (the first step's 9 s excluded)
