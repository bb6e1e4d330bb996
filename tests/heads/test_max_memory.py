"""`SweepOptions(max_memory=...)` honoured by every sweeping analysis (issue 41 item 4).

Per family of sweep — a forward sweep (activation and path patching), a gradient sweep (the
attribution estimate), a pattern reader (the detectors) — a budget lowers the rows per forward,
seen on the forwards themselves (a counter on the backend's entry point), to the rows the
memory plan fits in the budget; a budget below one row is refused before any forward, the
planned minimum named; the scores do not change. One real run checks the measured peak RSS
stays under the budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from heads import SweepOptions, encode_prompts
from heads.errors import HeadsteerValueError
from heads.planning import plan_memory, rows_within
from heads.scorers.patching import lean
from heads.scorers.patching.activation import patch
from heads.scorers.patching.pairs import encode_pairs
from heads.scorers.patching.path import path_patch
from heads.scorers.patching.record import cache_bytes
from heads.scorers.roles.detectors import pattern_scores
from heads.scorers.safety.attribution import TEMPLATE, attribute
from heads.scorers.safety.common import encode_queries
from tests.support.patching import PAIRS


def _count_rows(model, monkeypatch) -> list[int]:
    """Batch rows of every forward `model` runs from now on (the backend's one entry point)."""
    seen: list[int] = []
    inner = model.backend.run

    def counted(**kw):
        x = kw.get("input_ids")
        seen.append(int((x if x is not None else kw["inputs_embeds"]).shape[0]))
        return inner(**kw)

    monkeypatch.setattr(model.backend, "run", counted)
    return seen


def _no_forward(model, monkeypatch) -> None:
    monkeypatch.setattr(model.backend, "run", lambda **kw: pytest.fail("a forward ran"))


def _opts(budget: int | None = None) -> SweepOptions:
    return SweepOptions(progress=False, max_memory=budget)


@pytest.mark.parametrize("which", ["patch", "path_patch"])
def test_forward_sweeps_fit_their_rows_to_the_budget(tiny_llama, tokenizer, monkeypatch, which):
    pairs = encode_pairs(tokenizer, PAIRS)
    T, N = pairs.width, pairs.n
    keys = which == "patch"

    def run(options):
        if which == "patch":
            return patch(tiny_llama, pairs, "head_out", options=options).raw
        return path_patch(tiny_llama, pairs, options=options).raw

    seen = _count_rows(tiny_llama, monkeypatch)
    free = run(_opts())
    assert max(seen[2:]) > 3  # without a budget the sweep's forwards take more than 3 rows
    # the recorded clean and corrupted runs stay alive beside the sweep's forwards
    kept = 2 * cache_bytes(tiny_llama, N, T, keys=keys)
    budget = plan_memory(tiny_llama, "forward", T, 3).peak + kept
    assert rows_within(tiny_llama, budget - kept, "forward", T) == 3
    seen.clear()
    got = run(_opts(budget))
    assert seen[:2] == [N, N]  # the two recorded runs, every pair
    assert max(seen[2:]) == 3 and len(seen) > 3
    torch.testing.assert_close(got, free, rtol=0, atol=1e-5, equal_nan=True)
    # below one row (the recorded runs kept beside it; for patch the lean path's sites, its
    # minimum, heads.scorers.patching.lean): refused before any forward, minimum named
    _no_forward(tiny_llama, monkeypatch)
    if which == "patch":
        kept = lean.lean_bytes(tiny_llama, "head_out", N, T, range(tiny_llama.n_layers), 0)
    one = plan_memory(tiny_llama, "forward", T, N).peak + kept
    with pytest.raises(HeadsteerValueError, match=r"needs at least .* max_memory is"):
        run(_opts(one - 1))


def test_gradient_sweep_fits_its_rows_to_the_budget(tiny_llama, monkeypatch):
    prompts = ["Hello there", "How do I bake bread?", "Tell me a joke", "What is two plus two?"]
    seen = _count_rows(tiny_llama, monkeypatch)
    free = attribute(tiny_llama, prompts)
    assert max(seen) == len(prompts)
    T = encode_queries(tiny_llama, prompts, TEMPLATE).length
    budget = plan_memory(tiny_llama, "gradient", T, 2).peak
    assert plan_memory(tiny_llama, "gradient", T, 3).peak > budget
    seen.clear()
    got = attribute(tiny_llama, prompts, options=SweepOptions(max_memory=budget))
    assert max(seen) == 2 and sum(seen) >= len(prompts)
    torch.testing.assert_close(got.per_prompt, free.per_prompt, rtol=1e-4, atol=1e-6)
    _no_forward(tiny_llama, monkeypatch)
    need = plan_memory(tiny_llama, "gradient", T, 1).peak
    with pytest.raises(HeadsteerValueError, match=r"gradient on 1 x \d+ tokens needs at least"):
        attribute(tiny_llama, prompts, options=SweepOptions(max_memory=need - 1))


def test_pattern_reader_fits_its_rows_to_the_budget(tiny_llama, monkeypatch):
    texts = ["one two three one two three", "a b c d a b c d", "red green blue red", "x y z x y z x"]
    enc = encode_prompts(tiny_llama.tokenizer, texts, chat=False)
    seen = _count_rows(tiny_llama, monkeypatch)
    free = pattern_scores(tiny_llama, enc, options=SweepOptions())
    assert seen == [len(texts)]
    budget = plan_memory(tiny_llama, "detectors", enc.length, 2).peak
    seen.clear()
    got = pattern_scores(tiny_llama, enc, options=SweepOptions(max_memory=budget))
    assert seen == [2, 2]
    for name in free:
        torch.testing.assert_close(got[name].scores, free[name].scores, rtol=1e-5, atol=1e-6)
    _no_forward(tiny_llama, monkeypatch)
    need = plan_memory(tiny_llama, "detectors", enc.length, 1).peak
    with pytest.raises(HeadsteerValueError, match=r"detectors on 1 x \d+ tokens needs at least"):
        pattern_scores(tiny_llama, enc, options=SweepOptions(max_memory=need - 1))


def test_lens_collection_fits_its_texts_to_the_budget(tiny_llama, monkeypatch):
    """The lens data (every position's logits kept: the `"logits"` plan) with the kept outputs
    and fp16 logits of `max_positions` positions beside the forwards."""
    from heads.scorers.roles.lens_data import collect_lens_data

    texts = ["one two three four", "five six seven", "eight nine ten eleven twelve", "red green blue"]
    T = encode_prompts(tiny_llama.tokenizer, texts, chat=False, markup=False).length
    seen = _count_rows(tiny_llama, monkeypatch)
    free = collect_lens_data(tiny_llama, texts, max_positions=64)
    assert seen == [len(texts)]
    kept = 64 * (
        tiny_llama.n_layers * tiny_llama.n_heads * tiny_llama.d_model * 4 + tiny_llama.d_vocab * 2 + 16
    )
    budget = plan_memory(tiny_llama, "logits", T, 2).peak + kept
    assert plan_memory(tiny_llama, "logits", T, 3).peak + kept > budget
    seen.clear()
    got = collect_lens_data(tiny_llama, texts, max_positions=64, options=SweepOptions(max_memory=budget))
    assert seen == [2, 2]
    torch.testing.assert_close(got.outputs, free.outputs, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.token_ids, free.token_ids)


_RSS_RUN = textwrap.dedent(
    """
    import json
    import torch
    from heads import SweepOptions, load_tokenizer
    from heads.inputs.prompts import EncodedPrompts
    from heads.planning import plan_memory
    from heads.scorers.roles.detectors import pattern_scores
    from tests.support import make_tiny

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def peak_above_now(fn):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM restarts from the current RSS
        base = status("VmRSS")
        fn()
        return status("VmHWM") - base

    torch.set_num_threads(1)
    T, N = 512, 12
    hm = make_tiny("llama", load_tokenizer(), num_attention_heads=16, num_key_value_heads=4,
                   hidden_size=256, max_position_embeddings=1024)
    half = torch.randint(100, 40000, (N, T // 2), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([half, half], 1)
    enc = EncodedPrompts(ids, torch.ones_like(ids), [[]] * N, [""] * N, [[]] * N)
    two, three = (plan_memory(hm, "detectors", T, b).peak for b in (2, 3))
    budget = (two + three) // 2  # two rows fit, three do not
    weights = plan_memory(hm, "detectors", T, 1).devices[0].weights  # resident already
    small = EncodedPrompts(ids[:1, :32], torch.ones_like(ids[:1, :32]), [[]], [""], [[]])
    pattern_scores(hm, small, options=SweepOptions(max_memory=budget))  # lazy imports, one-time state
    capped = peak_above_now(lambda: pattern_scores(hm, enc, options=SweepOptions(max_memory=budget)))
    free = peak_above_now(lambda: pattern_scores(hm, enc, options=SweepOptions(max_rows=N)))
    print(json.dumps({"budget": budget, "weights": weights, "capped": capped, "free": free}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak RSS")
def test_measured_peak_rss_stays_under_the_budget():
    """A real run in a fresh process: its peak RSS above the loaded model (`VmHWM`, with big
    blocks returned to the OS when freed so RSS follows live memory) stays within the budget
    less the resident weights, where the same run without a budget goes over it."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _RSS_RUN], capture_output=True, text=True, env=env, cwd=root, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    room = got["budget"] - got["weights"]
    assert got["capped"] <= room, got
    assert got["free"] > room, got  # the budget is what kept the run under it


def _knockout_pairs():
    from heads.scorers.patching import pairs_from_tokens

    clean, corrupted = [[40, 41, 42, 43, 44, 45]], [[40, 41, 49, 43, 44, 45]]
    return pairs_from_tokens(clean, corrupted, [[20]], [[21]], positions={"IO": [2]})


_PROMPTS = ["Hello there", "How do I bake bread?", "Tell me a joke"]
_ITEMS = [
    {"question": "Where was Orlan born?", "passages": ["Orlan was born in Delmar.", "Mira sings."], "gold": 0}
]


def _relation(model):
    from heads.scorers.maps.static import RelationPairs

    return RelationPairs("r", [(4000, 4001), (5000, 5001)], 1, [("France", "Paris"), ("Japan", "Tokyo")])


def _sweeps(tokenizer):
    """Every other sweep taking `options`, called with `max_memory` (a `SweepOptions` -> call)."""
    from heads.scorers.circuits.circuit import find_circuit
    from heads.scorers.circuits.scores import edge_scores, exact_scores
    from heads.scorers.gating import gate_heads, gate_task
    from heads.scorers.maps.inference import dynamic_scores
    from heads.scorers.patching.evaluate import evaluate_pairs
    from heads.scorers.patching.knockout import knockout
    from heads.scorers.retrieval.qrhead import qrhead_scores
    from heads.scorers.roles.lens import train_lens
    from heads.scorers.roles.needle import retrieval_scores
    from heads.scorers.safety.attribution import sahara_candidates
    from heads.scorers.safety.ships import dataset_ships, sahara, ships

    pairs = encode_pairs(tokenizer, PAIRS)
    return {
        "knockout": lambda m, o: knockout(m, _knockout_pairs(), "IO", options=o),
        "edge_scores": lambda m, o: edge_scores(m, pairs, method="eap", options=o),
        "exact_scores": lambda m, o: exact_scores(m, pairs, options=o),
        "find_circuit": lambda m, o: find_circuit(m, pairs, method="eap", n=3, options=o),
        "qrhead_scores": lambda m, o: qrhead_scores(m, _ITEMS, chat=False, options=o),
        "gate_heads": lambda m, o: gate_heads(
            m, gate_task(m, _PROMPTS, [" a", " b", " c"]), steps=1, options=o
        ),
        "dataset_ships": lambda m, o: dataset_ships(m, _PROMPTS, options=o),
        "sahara": lambda m, o: sahara(m, _PROMPTS, steps=1, options=o),
        "ships_attribution": lambda m, o: ships(m, _PROMPTS, method="attribution", confirm=1, options=o),
        "evaluate_pairs": lambda m, o: evaluate_pairs(m, pairs, options=o.replace(progress=True)),
        "retrieval_scores": lambda m, o: retrieval_scores(m, n_prompts=2, options=o.replace(progress=True)),
        "dynamic_scores": lambda m, o: dynamic_scores(m, _relation(m), options=o),
        "train_lens": lambda m, o: train_lens(m, ["one two three", "four five six"], options=o),
        "sahara_candidates": lambda m, o: sahara_candidates(
            m, _PROMPTS, k=2, options=o.replace(progress=True)
        ),
    }


SWEEPS = (
    "knockout",
    "edge_scores",
    "find_circuit",
    "exact_scores",
    "qrhead_scores",
    "gate_heads",
    "dataset_ships",
    "sahara",
    "ships_attribution",
    "sahara_candidates",
    "train_lens",
    "dynamic_scores",
    "evaluate_pairs",
    "retrieval_scores",
)


@pytest.mark.parametrize("name", SWEEPS)
def test_every_sweep_refuses_a_budget_below_its_minimum_before_any_forward(
    tiny_llama, tokenizer, monkeypatch, name
):
    call = _sweeps(tokenizer)[name]
    _no_forward(tiny_llama, monkeypatch)
    with pytest.raises(HeadsteerValueError, match=r"needs at least \S+ \wB .* max_memory is 1 KB"):
        call(tiny_llama, SweepOptions(progress=False, max_memory="1KB"))


def test_run_never_drops_a_budget(tiny_llama, monkeypatch):
    """`run(..., options=SweepOptions(max_memory=...))`: an analysis without sweep options refuses
    the budget by name; one that takes only `progress` gets the budget too (honoured or refused);
    the sink statistics (one forward, not split) check it before their forward. Never dropped."""
    from heads import run
    from heads.scorers.maps.request import MapsRequest
    from heads.scorers.sink_requests import SinkDimsRequest, SinkStatsRequest

    _no_forward(tiny_llama, monkeypatch)
    opts = SweepOptions(progress=False, max_memory="100GB")
    with pytest.raises(HeadsteerValueError, match=r"sink_dims request takes no SweepOptions\(max_memory=\)"):
        run(tiny_llama, SinkDimsRequest(), ["Hello"], options=opts)
    with pytest.raises(HeadsteerValueError, match="maps_scores does not take max_memory"):
        run(tiny_llama, MapsRequest(), [("France", "Paris")], options=opts)
    with pytest.raises(
        HeadsteerValueError, match=r"sinks on 2 x \d+ tokens needs at least .* max_memory is 1 KB"
    ):
        run(
            tiny_llama,
            SinkStatsRequest(chat=False),
            ["Hello", "Hi there"],
            options=SweepOptions(max_memory="1KB"),
        )


def test_refusal_names_one_row_unless_only_the_whole_run_misses(tiny_llama):
    """The minimum named is one row's plan (weights included), not the `whole` run's; a budget
    that fits one row but not the unsplit run names that run's rows and says they run at once."""
    T, N = 15, 8
    one = plan_memory(tiny_llama, "forward", T, 1).peak
    whole = plan_memory(tiny_llama, "forward", T, N).peak
    assert one < whole
    with pytest.raises(HeadsteerValueError, match=rf"on 1 x {T} tokens needs at least") as err:
        SweepOptions(max_memory=one - 1).within(tiny_llama, T, whole=N)
    assert "in one forward" not in str(err.value)
    with pytest.raises(HeadsteerValueError, match=rf"on {N} x {T} tokens .* the {N} rows run in one forward"):
        SweepOptions(max_memory=whole - 1).within(tiny_llama, T, whole=N)
    assert SweepOptions(max_memory=whole).within(tiny_llama, T, whole=N).max_rows >= 1
