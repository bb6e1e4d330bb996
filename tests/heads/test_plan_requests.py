"""Memory plans of the analysis requests (issue 41 item 4): every request `headsteer run` accepts
plans as its analysis or is refused by name; activation / path patching plans against the live
bytes of the real sweeps; a budget below a run's minimum refused from the config alone, before any
weight loads (`headsteer run --max-memory`); the default patching path lean at long prompts for
every kind and position spec (`heads.planning.patching`, shared by `choose_lean` and the plan)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from heads import HeadModel, SweepOptions
from heads.errors import HeadsteerValueError
from heads.planning import plan_memory
from heads.planning.patching import LEAN_ALWAYS_BYTES, PATCH_KINDS, patch_kept
from heads.planning.requests import NO_PLAN, REQUEST_PLANS
from heads.planning.trace import LiveBytes
from heads.scorers.patching import lean
from heads.scorers.patching.activation import _sites, patch
from heads.scorers.patching.path import path_patch
from heads.scorers.patching.record import cache_bytes
from heads.scorers.request_base import _REGISTRY

CFG = LlamaConfig(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
SMOL = dict(n_layers=30, n_heads=9, n_kv_heads=3, d_head=64, d_model=576)  # SmolLM2-135M's geometry


def _instance(cls):
    required = {"knockout": {"keys": [1]}, "qk_attribution": {"head": (0, 0)}}
    return cls(**required.get(cls.NAME, {}))


def test_every_request_plans_as_its_analysis_or_is_refused_by_name():
    """The registry walked: each request has a plan (a `MemoryPlan` whose analysis is the one its
    sweep plans with) or a refusal naming it and why; the requests that take no budget
    (`dispatch._NO_OPTIONS`) are the refused ones, with MAPS (which refuses `max_memory`)."""
    from heads.scorers import dispatch

    assert set(REQUEST_PLANS) | set(NO_PLAN) == set(_REGISTRY)
    assert not set(REQUEST_PLANS) & set(NO_PLAN)
    assert {c.NAME for c in dispatch._NO_OPTIONS} | {"maps_scores"} == set(NO_PLAN)
    for name, cls in _REGISTRY.items():
        request = _instance(cls)
        if name in NO_PLAN:
            with pytest.raises(HeadsteerValueError, match=rf"a {name} request has no memory plan \("):
                plan_memory(CFG, request, 32)
            continue
        plan = plan_memory(CFG, request, 32)
        assert plan.peak > plan_memory(CFG, "forward", 1).peak, name
    assert plan_memory(CFG, _REGISTRY["patch"](kind="q"), 32).request.params["kind"] == "q"
    ships = _REGISTRY["ships"]
    assert plan_memory(CFG, ships(method="attribution"), 32).request.analysis == "gradient"
    assert plan_memory(CFG, ships(), 32).request.analysis == "forward"


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(**dict(CFG.to_dict(), hidden_size=128, intermediate_size=256))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    return HeadModel(hf, None, "t")


def _pairs(T: int = 192):
    """Two random pairs of `T` tokens whose prompts differ at two columns (the vocabulary: 1,000)."""
    from heads.scorers.patching import pairs_from_tokens

    clean = torch.randint(10, 1000, (2, T), generator=torch.Generator().manual_seed(0))
    corrupted = clean.clone()
    corrupted[:, T // 3] = 7
    corrupted[:, T - 5] = 8
    return pairs_from_tokens(clean.tolist(), corrupted.tolist(), [3, 3], [4, 4])


def _live(hm, run) -> int:
    run()  # one-time state (lazy buffers) outside the count
    tracker = LiveBytes()
    tracker.ignore(list(hm.model.parameters()) + list(hm.model.buffers()))
    with torch.no_grad(), tracker:
        run()
    return tracker.peak


@pytest.mark.parametrize(
    ("kind", "layers", "positions", "mode"),
    [
        ("resid_pre", [1], [-1], "lean"),
        ("head_out", [1], None, "lean"),
        ("resid_pre", [1], [-1], "full"),
        ("q", None, None, "full"),
    ],
)
def test_patch_plans_within_15_percent_of_the_live_bytes(model, monkeypatch, kind, layers, positions, mode):
    """`plan_memory(config, PatchRequest)`: the recorded run of every pair beside what the path
    keeps (its sites, or both runs' full caches), against the live bytes the sweep counts."""
    from heads.planning.patching import full_cache_bytes, lean_kept_bytes
    from heads.planning.plan import geometry

    pairs = _pairs()
    T, N = pairs.width, pairs.n
    monkeypatch.setattr(lean, "MODE", mode)
    opts = SweepOptions(progress=False, max_rows=N)  # the patched forwards' rows: the recorded runs' N
    measured = _live(
        model, lambda: patch(model, pairs, kind, layers=layers, positions=positions, options=opts)
    )
    g, item = geometry(model.model.config), 4
    lays = list(range(3)) if layers is None else layers
    n_pos = 0 if positions is None else len(positions)
    kept = lean_kept_bytes(g, item, kind, N, T, lays, n_pos)
    if mode == "full":
        kept = 2 * full_cache_bytes(g, item, N, T, query=kind == "q", keys=False)
    assert kept == (
        lean.lean_bytes(model, kind, N, T, lays, n_pos)
        if mode == "lean"
        else 2 * cache_bytes(model, N, T, query=kind == "q", keys=False)
    )
    planned = plan_memory(model, "forward", T, N).devices[0].activations + kept
    assert abs(planned - measured) <= 0.15 * measured, (planned, measured)
    # the request's own plan: the default path's (short prompts: the full caches)
    request = _REGISTRY["patch"](kind=kind, layers=layers, positions=positions)
    full = 2 * full_cache_bytes(g, item, N, T, query=kind == "q", keys=False)
    assert (
        plan_memory(model, request, T, N).devices[0].activations
        == plan_memory(model, "forward", T, N).devices[0].activations + full
    )


def test_path_patch_plans_within_15_percent_of_the_live_bytes(model):
    pairs = _pairs()
    measured = _live(
        model, lambda: path_patch(model, pairs, senders=[(0, 1)], options=SweepOptions(progress=False))
    )
    planned = plan_memory(model, "path_patch", pairs.width, pairs.n).devices[0].activations
    assert abs(planned - measured) <= 0.15 * measured, (planned, measured)


def _stand_in(width: int, n: int = 1):
    """SmolLM2's geometry on the `hf` backend (the plan's assumption: the fast path can record)."""
    hf, family = SimpleNamespace(attention_via_hooks=False), SimpleNamespace(attn_out_norm=None)
    model = SimpleNamespace(**SMOL, dtype=torch.float32, backend=hf, family=family)
    model.n_layers = SMOL["n_layers"]
    return model, SimpleNamespace(n=n, width=width)


@pytest.mark.parametrize("width", [1024, 2048, 8192])
def test_the_default_is_lean_for_every_kind_and_position_spec_at_long_prompts(width):
    """At 1k-8k tokens on SmolLM2's geometry every kind, with positions at the end, at a third
    and everywhere, one layer or all, takes the lean path (`resid_pre` at the last position of every
    layer kept both runs' full caches: 2.2 GB of RSS at 1,024 tokens); `choose_lean` and the plan
    make the same choice (one rule)."""
    g = {**SMOL}
    hm, pairs = _stand_in(width)
    for kind in PATCH_KINDS:
        by_pos = kind in ("resid_pre", "attn_out", "mlp_out", "head_out_by_pos")
        for layers in ([15], list(range(30))):
            for positions in ([-1], [width // 3], None) if by_pos else (None,):
                if by_pos and positions is None and len(layers) > 1 and width > 1024:
                    continue  # T x L sites: too many to list quickly; the one-layer case shows it
                poss = list(range(width)) if positions is None else [p % width for p in positions]
                sites, _ = _sites(hm, kind, layers, poss if by_pos else [])
                chosen, _ = lean.choose_lean(
                    hm, pairs, kind, sites, layers, len(poss) if by_pos else 0, SweepOptions()
                )
                planned, kept = patch_kept(g, 4, kind, 1, width, layers, positions)
                assert chosen and planned, (kind, layers, positions)
                full = 2 * cache_bytes(hm, 1, width, pattern=kind == "pattern", query=kind == "q")
                # every layer's patterns are what that sweep reads: kept by either path
                assert kept < full / 2 or (kind == "pattern" and len(layers) > 1), (kind, layers)


def test_choose_lean_and_the_plan_agree_at_every_size():
    """Around the thresholds (short, middle, long prompts) the sweep's choice is the plan's."""
    g = {**SMOL}
    for width in (16, 200, 400, 700, 1024):
        hm, pairs = _stand_in(width)
        for kind, layers, positions in (
            ("resid_pre", [15], [-1]),
            ("resid_pre", list(range(30)), [-1]),
            ("resid_pre", [3], [width // 3]),
            ("head_out", [15], None),
        ):
            poss = [p % width for p in positions] if positions else []
            sites, _ = _sites(hm, kind, layers, poss)
            chosen, _ = lean.choose_lean(hm, pairs, kind, sites, layers, len(poss), SweepOptions())
            assert chosen == patch_kept(g, 4, kind, 1, width, layers, positions)[0], (width, kind, layers)
    assert 2 * cache_bytes(_stand_in(700)[0], 1, 700) > LEAN_ALWAYS_BYTES  # lean from ~610 tokens on


def test_run_refuses_a_budget_below_its_minimum_before_loading(tiny_llama_dir, tmp_path, monkeypatch):
    """`headsteer run --max-memory`: planned from the config alone, refused before any weight loads
    (it was refused by the sweep after loading), naming the minimum; the loader and transformers'
    `from_pretrained` fail the test if called."""
    from transformers import AutoModelForCausalLM as Auto
    from typer.testing import CliRunner

    import heads
    from tests.support.cli import one_line_error
    from viz.cli import app

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(heads, "load_model", boom)
    monkeypatch.setattr(Auto, "from_pretrained", boom)
    req = tmp_path / "req.json"
    for body, inputs in (
        ({"request": "patch", "kind": "resid_pre"}, ["--inputs", "ioi", "--n", "2"]),
        ({"request": "sink_stats", "chat": False}, ["--inputs", str(tmp_path / "p.txt")]),
    ):
        (tmp_path / "p.txt").write_text("Hello there\nHow are you\n")
        req.write_text(json.dumps(body))
        args = ["run", str(req), "--model", tiny_llama_dir, "--out", str(tmp_path / "o.json"), *inputs]
        r = CliRunner().invoke(app, [*args, "--max-memory", "1KB"])
        one_line_error(r, "needs at least")
        assert "--max-memory is 1 KB" in r.output and "the model was loaded" not in r.output
        # a budget that fits gets as far as loading the weights
        r = CliRunner().invoke(app, [*args, "--max-memory", "100GB"])
        assert "the model was loaded" in str(r.exception) or "the model was loaded" in r.output, r.output
    req.write_text(json.dumps({"request": "direct_logit_attribution"}))
    args = ["run", str(req), "--model", tiny_llama_dir, "--out", str(tmp_path / "o.json")]
    r = CliRunner().invoke(app, [*args, "--inputs", "ioi", "--n", "2", "--max-memory", "100GB"])
    one_line_error(r, "a direct_logit_attribution request takes no --max-memory")
    # patch(method="attribution") refuses a budget when it runs: refused here, before loading, for
    # any budget (it loaded and refused, or named a plain forward's minimum: breaker)
    req.write_text(json.dumps({"request": "patch", "kind": "head_out", "method": "attribution"}))
    for budget in ("1KB", "100GB"):
        r = CliRunner().invoke(app, [*args, "--inputs", "ioi", "--n", "2", "--max-memory", budget])
        one_line_error(r, "patch(method='attribution') has no memory plan")
        assert "the model was loaded" not in r.output


def test_plan_with_a_budget_plans_what_the_run_takes_under_it(tiny_llama_dir, tmp_path):
    """`headsteer plan --request FILE --batch N --max-memory B`: where the request's plan does not
    fit B but what its run takes under B does (a sweep shrinks its batch; EAP takes its lean path),
    that plan is shown, not refused (breaker: find_circuit under 600 MB "needs at least 796 MB"
    while its run fit; its plan now counts the exact evaluations, which both paths share)."""
    from typer.testing import CliRunner

    from heads import AttributionRequest
    from heads.planning.budget import minimum_plan
    from viz.cli import app

    req = tmp_path / "atp.json"
    req.write_text(json.dumps({"request": "attribution_patching"}))
    least = minimum_plan(tiny_llama_dir, AttributionRequest(), 256, 4).peak
    full = plan_memory(tiny_llama_dir, AttributionRequest(), 256, 4).peak
    assert least < full
    base = ["plan", "--model", tiny_llama_dir, "--tokens", "256", "--batch", "4", "--request", str(req)]
    r = CliRunner().invoke(app, [*base, "--json", "--quiet", "--max-memory", str((least + full) // 2)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["batch"] == 1
    r = CliRunner().invoke(app, [*base, "--max-memory", str(least - 1)])
    assert r.exit_code == 2 and "needs at least" in r.output


def test_fractional_bare_bytes_and_huge_batches_are_refused_by_value():
    """`parse_bytes("1.5")` was read as 1 byte (the number 1.5 was refused); a batch of 10**14 rows
    failed inside the tracer with an overflow (breaker)."""
    from heads.errors import HeadsteerValueError
    from heads.planning import parse_bytes

    with pytest.raises(HeadsteerValueError, match="fractional number of bytes"):
        parse_bytes("1.5")
    assert parse_bytes("1.5KB") == 1500 and parse_bytes("2") == 2
    with pytest.raises(HeadsteerValueError, match="batch"):
        plan_memory(CFG, "forward", 10, 10**14)


@pytest.mark.parametrize("kind", ["head_out", "resid_pre", "k"])
def test_lean_forwards_take_one_row_on_long_rows_with_the_same_scores(model, monkeypatch, kind):
    """`lean.LEAN_ROW_TOKENS`: rows of a long prompt run one per forward, the recorded runs' pairs
    too (9 rows of `head_out` at 1,024 tokens peaked at 9 forwards' memory); the scores equal the
    fast path's; the plan of `patch` then counts one row's forward beside what it keeps."""
    pairs = _pairs(64)
    opts = SweepOptions(progress=False)
    monkeypatch.setattr(lean, "MODE", "full")
    want = patch(model, pairs, kind, layers=[1], options=opts).raw
    monkeypatch.setattr(lean, "MODE", "lean")
    monkeypatch.setattr(lean, "LEAN_ROW_TOKENS", 64)  # rows of 64 tokens count as long here
    seen = []
    run = lean.run_rows

    def spy(model, ids, *a, **k):
        seen.append(ids.shape[0])
        return run(model, ids, *a, **k)

    monkeypatch.setattr(lean, "run_rows", spy)
    got = patch(model, pairs, kind, layers=[1], options=opts).raw
    assert len(seen) > 5 and set(seen) == {1}  # the recorded runs pair by pair too, then each row
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6, equal_nan=True)
    from heads.planning.patching import LEAN_ROW_TOKENS

    T = 2 * LEAN_ROW_TOKENS  # long: the lean path, one row per forward, the 8 pairs' runs included
    smol = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    )  # fmt: skip
    request = _REGISTRY["patch"](kind="resid_pre", layers=[15], positions=[-1])
    lean_path, kept = patch_kept(SMOL, 4, "resid_pre", 8, T, [15], [-1])
    assert lean_path and kept < T * 576 * 4 * 8 * 1.01  # the residual entering layer 15, per pair
    plan = plan_memory(smol, request, T, 8).devices[0].activations
    assert plan == plan_memory(smol, "forward", T, 1).devices[0].activations + kept


def test_circuit_report_refuses_a_budget_below_its_minimum_before_loading(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """`headsteer report circuit --max-memory`: the lean EAP path's plan of one pair of the task,
    from the config and tokenizer alone, before the weights (it was refused after loading)."""
    from transformers import AutoModelForCausalLM as Auto
    from typer.testing import CliRunner

    import heads
    from tests.support.cli import one_line_error
    from viz.cli import app

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(heads, "load_model", boom)
    monkeypatch.setattr(Auto, "from_pretrained", boom)
    args = ["report", "circuit", "--model", tiny_llama_dir, "--pairs", "2", "--out", str(tmp_path / "c.html")]
    r = CliRunner().invoke(app, [*args, "--max-memory", "2MB"])
    one_line_error(r, "find_circuit on 1 x ")
    assert "needs at least" in r.output and "--max-memory is 2 MB" in r.output
    r = CliRunner().invoke(app, [*args, "--max-memory", "24GB"])
    assert "the model was loaded" in r.output, r.output


def test_cli_plan_reads_a_run_request(tiny_llama_dir, tmp_path):
    """`headsteer plan --request FILE`: the request `headsteer run` takes, planned as its analysis
    from the config alone (no weights in the folder), or refused by name."""
    import shutil

    from typer.testing import CliRunner

    from tests.support.cli import one_line_error
    from viz.cli import app

    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(f"{tiny_llama_dir}/config.json", folder / "config.json")
    req = tmp_path / "req.json"
    req.write_text(json.dumps({"request": "patch", "kind": "resid_pre", "positions": [-1]}))
    base = ["plan", "--model", str(folder), "--tokens", "64", "--batch", "2"]
    r = CliRunner().invoke(app, [*base, "--request", str(req), "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["analysis"] == "patch" and got["params"]["positions"] == [-1] and got["batch"] == 2
    r = CliRunner().invoke(app, [*base, "--request", str(req)])
    assert r.exit_code == 0 and "patch (resid_pre): 64 tokens x 2" in r.output  # the title names the kind
    req.write_text(json.dumps({"request": "logit_lens"}))
    r = CliRunner().invoke(app, [*base, "--request", str(req)])
    one_line_error(r, "a logit_lens request has no memory plan", ignore=("planning",))
    r = CliRunner().invoke(app, [*base, "--request", str(req), "--analysis", "sinks"])
    one_line_error(r, "not both", ignore=("planning",))


def test_patch_frame_names_the_token_column_and_its_token(model):
    """`PatchResult.to_frame()`: `position` is the padded column patched (it was the index along
    the position axis: 0, 1 for `positions=[5, -1]`), `token` pair 0's token there."""
    pairs = _pairs(32)
    res = patch(
        model, pairs, "resid_pre", layers=[1, 2], positions=[5, -1], options=SweepOptions(progress=False)
    )
    frame = res.to_frame()
    labels = pairs.position_labels(0)
    assert sorted(set(frame["position"])) == [5, 31]
    assert all(row.token == labels[row.position] for row in frame.itertuples())
    assert list(frame["layer"].unique()) == [1, 2] and len(frame) == 4
    want = res.mean[:, 1].tolist()  # the last column's scores, by layer
    assert frame[frame["position"] == 31]["score"].tolist() == pytest.approx(want, abs=0, nan_ok=True)
