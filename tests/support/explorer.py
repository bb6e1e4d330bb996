"""Shared helpers of the explorer's API tests (tests/viz/test_explorer*.py): the prompt, the
event-stream readers, the fake detectors and the job / streamer stubs."""

import json

import torch

PROMPT = "Ignore this. **Remember the word apple** and say something"


def events(text: str) -> list[dict]:
    return [json.loads(ln[6:]) for ln in text.split("\n\n") if ln.startswith("data: ")]


def scored(client, body, path="/api/scores"):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    ev = events(r.text)
    assert "job" in ev[0], ev[0]
    return ev


def fake_detectors(model, monkeypatch):
    """Random detector scores in place of the (slow) real detectors: the app's plumbing is tested."""
    from heads.results.scores import HeadScores
    from heads.scorers.roles import detectors

    g = torch.Generator().manual_seed(0)

    def fake(*names):
        def run(m, *a, **k):
            out = {
                n: HeadScores(torch.rand(m.n_layers, m.n_heads, generator=g), n, model=m.name) for n in names
            }
            return out if len(names) > 1 else out[names[0]]

        return run

    monkeypatch.setattr(detectors, "pattern_scores", fake("induction", "previous_token", "self"))
    for name in ("copying", "successor", "retrieval"):
        monkeypatch.setattr(detectors, f"{name}_scores", fake(name))
    return fake


def cancel_on_start(jobs):
    """Make every job of `jobs` cancelled as soon as it registers (before its work runs);
    returns the real `start` to put back."""
    real_start = jobs.start

    def start_and_cancel(j):
        flag = real_start(j)
        flag.set()
        return flag

    jobs.start = start_and_cancel
    return real_start


def gated_streamer(monkeypatch, after: int) -> dict:
    """Make the explorer's generation stream `after` text pieces, then wait for its job's cancel
    flag (so it cannot end on its own before the test cancels it); records every piece emitted
    and those emitted once the flag was set."""
    import viz.explorer.routes.generate as gen

    real = gen._Streamer
    record: dict = {"emitted": [], "after_cancel": []}

    def make(tokenizer, emit, flag):
        def watched(ev):
            if "text" in ev:
                record["emitted"].append(ev["text"])
                if flag.is_set():
                    record["after_cancel"].append(ev["text"])
            emit(ev)

        s = real(tokenizer, watched, flag)
        put = s.put

        def gated_put(value):
            if len(record["emitted"]) >= after:
                assert flag.wait(60), "the test never cancelled"
            put(value)

        s.put = gated_put
        return s

    monkeypatch.setattr(gen, "_Streamer", make)
    return record
