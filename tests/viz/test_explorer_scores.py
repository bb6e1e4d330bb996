"""The explorer's DLA, Ships, MAPS and probes grids: equal to the library scorers, with progress, and
cancelled before or during a run."""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from tests.support.explorer import PROMPT, cancel_on_start, scored
from viz.explorer import create_explorer

# ----------------------------------------------------------------------- dla, ships, maps, probes
NEW_SCORES = ("dla", "ships", "maps", "probes")


def progress_of_events(ev: list[dict]) -> list[list[int]]:
    got = [e["progress"] for e in ev if "progress" in e]
    assert got, ev
    assert all(0 <= d <= t for d, t in got) and [d for d, _ in got] == sorted(d for d, _ in got)
    assert got[-1][0] == got[-1][1]  # ends at its total
    return got


def oracle_dla(model, prompt):
    """The library's per-head direct logit of the model's own top next token (last position)."""
    from heads.engine.forward import forward
    from heads.inputs.prompts import encode_prompts
    from heads.scorers.patching.logit import head_logits
    from heads.scorers.patching.pairs import PromptPair, encode_pairs

    text = encode_prompts(model.tokenizer, prompt).texts[0]
    logits = forward(model, encode_prompts(model.tokenizer, text, chat=False, markup=False))[0, -1]
    top, second = logits.topk(2).indices.tolist()
    answer, _ = head_logits(model, encode_pairs(model, [PromptPair(text, text, top, second)]))
    return answer[0], top


def oracle_maps(model):
    from heads.scorers.maps.static import maps_scores
    from probes.datasets.relations import load_relations

    rels = load_relations(model.tokenizer, d_vocab=model.d_vocab).relations
    return maps_scores(model, rels, progress=False)


def oracle_probes(model):
    from probes.head_probes import collect_head_outputs, fit_head_probes, probe_data
    from viz.explorer.app import PROBE_LIMIT, PROBE_TASK

    data = probe_data(PROBE_TASK, "train", limit=PROBE_LIMIT)
    acts = collect_head_outputs(model, data.prompts, "last", chat=data.chat, progress=False)
    return fit_head_probes(acts, data.labels, groups=data.groups, model=model, progress=False), data


def rounded(t):
    return torch.tensor([[round(v, 5) for v in row] for row in t.float().tolist()])


def test_new_scores_equal_library_scorers_with_progress(model):
    """Each new grid equals its library scorer called directly (exact after rounding to 5
    decimals), progress events arrive, the head card then shows the head's values, and a
    second card for the same head computes nothing."""
    from heads.engine.options import SweepOptions
    from heads.inputs.prompts import encode_prompts
    from heads.inputs.tokens import readable_token
    from heads.scorers.safety.ships import ships

    app = create_explorer(model)
    client = TestClient(app)
    L, H = model.n_layers, model.n_heads
    got = {}
    for kind in NEW_SCORES:
        ev = scored(client, {"prompt": PROMPT, "score": kind})
        assert "result" in ev[-1], ev[-1]
        got[kind] = ev[-1]["result"]
        assert got[kind]["score"] == kind and torch.tensor(got[kind]["scores"]).shape == (L, H)
        steps = progress_of_events(ev)
        if kind in ("maps", "probes"):
            assert len(steps) >= L, steps  # maps: one per layer; probes: prompt batches, then heads
    want, top = oracle_dla(model, PROMPT)
    assert torch.equal(torch.tensor(got["dla"]["scores"]), rounded(want))
    assert got["dla"]["token"] == readable_token(model.tokenizer, top)
    plain = encode_prompts(model.tokenizer, PROMPT, chat=False).texts[0]
    assert "**" not in plain
    want = ships(model, plain, options=SweepOptions(progress=False)).scores.scores
    assert torch.equal(torch.tensor(got["ships"]["scores"]), rounded(want))
    ms = oracle_maps(model)
    stack = torch.stack([ms.relation[n].scores for n in ms.names()])
    assert torch.equal(torch.tensor(got["maps"]["scores"]), rounded(stack.amax(0)))
    assert set(got["maps"]["columns"]) == set(ms.names())
    for n in ms.names():
        assert torch.equal(torch.tensor(got["maps"]["columns"][n]), rounded(ms.relation[n].scores))
    for la in range(L):
        for h in range(H):
            name = got["maps"]["best_relation"][la][h]
            assert ms.relation[name].scores[la, h] == stack[:, la, h].max()
    res, data = oracle_probes(model)
    assert torch.equal(torch.tensor(got["probes"]["scores"]), rounded(res.accuracy.scores))
    assert torch.equal(torch.tensor(got["probes"]["columns"]["auc"]), rounded(res.auc.scores))
    assert got["probes"]["n"] == len(data.prompts) == res.n
    # the card shows every computed score's value for the head, from the caches
    from heads.scorers.maps import static
    from heads.scorers.roles import lens

    calls = []
    real_top, real_ops = lens.AttentionLens.top_tokens, static.salient_operations

    def count_top(self, *a, **k):
        calls.append("lens")
        return real_top(self, *a, **k)

    def count_ops(*a, **k):
        calls.append("maps")
        return real_ops(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lens.AttentionLens, "top_tokens", count_top)
        mp.setattr(static, "salient_operations", count_ops)
        first = client.post("/api/head", json={"prompt": PROMPT, "layer": 2, "head": 1}).json()
        assert calls == ["lens", "maps"]
        again = client.post("/api/head", json={"prompt": PROMPT, "layer": 2, "head": 1}).json()
        assert again == first and calls == ["lens", "maps"]  # nothing recomputed
        other = client.post("/api/head", json={"prompt": PROMPT + " more", "layer": 2, "head": 1}).json()
        assert calls == ["lens", "maps", "lens"]  # a new prompt: its lens only (MAPS is per head)
    assert set(first["scores"]) == set(NEW_SCORES)
    for kind in NEW_SCORES:
        assert first["scores"][kind] == got[kind]["scores"][2][1]
    assert set(other["scores"]) == {"maps", "probes"}  # dla / ships are per prompt
    assert first["maps_describe"] == ms.describe(2, 1)
    # asked again, a prompt's dla grid and the server's maps come from the caches: no progress
    for kind in ("dla", "maps", "probes"):
        ev = scored(client, {"prompt": PROMPT, "score": kind})
        assert ev[-1]["result"] == got[kind] and not any("progress" in e for e in ev)


def stop_after_first_step(monkeypatch, module, name):
    """Wrap `module.name` so that after its first progress step it waits until the test has
    posted `/api/cancel` (set the returned event); also returns the steps it reported."""
    import threading

    real = getattr(module, name)
    posted = threading.Event()
    seen: list[tuple[int, int]] = []

    def wrapped(*a, progress=None, **k):
        options = k.pop("options", None)  # an analysis taking SweepOptions gets its progress there
        if options is not None:
            progress = options.progress

        def step(done, total):
            seen.append((done, total))
            progress(done, total)  # the explorer's callback: raises once the job is cancelled
            if done > 0 and not posted.is_set():
                assert posted.wait(30)

        if options is not None:
            return real(*a, options=options.replace(progress=step), **k)
        return real(*a, progress=step, **k)

    monkeypatch.setattr(module, name, wrapped)
    return posted, seen


@pytest.mark.parametrize(
    ("kind", "module", "name"),
    [
        ("maps", "heads.scorers.maps.static", "run_maps"),  # the explorer runs a MapsRequest
        ("probes", "probes.head_probes", "collect_head_outputs"),
    ],
)
def test_cancel_stops_a_new_score_mid_run(model, monkeypatch, kind, module, name):
    import importlib

    app = create_explorer(model)
    client = TestClient(app)
    job = f"cancel-{kind}-0001"
    posted, seen = stop_after_first_step(monkeypatch, importlib.import_module(module), name)
    ev = []
    with client.stream("POST", "/api/scores", json={"prompt": PROMPT, "score": kind, "job": job}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                ev.append(json.loads(line[6:]))
                if "progress" in ev[-1] and ev[-1]["progress"][0] > 0 and not posted.is_set():
                    assert client.post("/api/cancel", json={"job": job}).json()["cancelled"] is True
                    posted.set()
    assert ev[-1] == {"cancelled": True}
    done = [e["progress"] for e in ev if "progress" in e]
    assert done and done[-1][0] < done[-1][1]  # stopped before its total
    assert len(seen) == 2 and seen[0][0] < seen[0][1]  # the scorer's next step raised
    assert app.state.jobs.running() == 0
    monkeypatch.undo()  # the next run is the real one, and completes
    ev = scored(client, {"prompt": PROMPT, "score": kind})
    assert "result" in ev[-1] and ev[-1]["result"]["score"] == kind


@pytest.mark.parametrize("kind", NEW_SCORES)
def test_new_scores_cancelled_before_start(model, kind):
    app = create_explorer(model)
    client = TestClient(app)
    jobs = app.state.jobs
    cancel_on_start(jobs)
    ev = scored(client, {"prompt": PROMPT, "score": kind, "job": f"pre-{kind}-0001"})
    assert ev[-1] == {"cancelled": True} and not any("progress" in e for e in ev)
    assert jobs.running() == 0


def test_score_names_in_info_and_bad_name(client):
    names = client.get("/api/info").json()["scores"]
    assert names == ["span", "sinks", "atlas", "dla", "ships", "maps", "probes"]
    r = client.post("/api/scores", json={"prompt": PROMPT, "score": "mapz"})
    assert r.status_code == 400 and "'mapz'" in r.json()["error"]
    assert all(n in r.json()["error"] for n in names)


def test_dla_on_an_unsupported_model_is_400_before_work(tokenizer):
    """A final norm that is neither an RMSNorm nor a LayerNorm (here an L1 norm without an
    `eps`) cannot be frozen: one line, HTTP 400, and the server goes on."""
    from tests.support import make_tiny

    hm = make_tiny("llama", tokenizer)

    class L1Norm(torch.nn.Module):
        def forward(self, x):
            return x / x.abs().mean(-1, keepdim=True)

    hm.model.model.norm = L1Norm()
    client = TestClient(create_explorer(hm))
    r = client.post("/api/scores", json={"prompt": PROMPT, "score": "dla"})
    err = r.json()["error"]
    assert r.status_code == 400 and ("freeze" in err or "frozen" in err) and "\n" not in err
    assert "result" in scored(client, {"prompt": PROMPT, "score": "ships"})[-1]
