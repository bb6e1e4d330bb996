"""The lean path of activation patching (`heads.scorers.patching.lean`): when `run_patch` takes it,
and that it keeps no full cache. Its exactness against the one-hook loop, every kind and both
directions, is in test_activation.py and test_family_patching.py (parametrized `path="lean"`)."""

from __future__ import annotations

import pytest

from heads import SweepOptions
from heads.errors import HeadsteerValueError
from heads.planning import plan_memory
from heads.scorers.patching import activation, lean
from heads.scorers.patching.activation import _sites, patch
from heads.scorers.patching.pairs import encode_pairs
from heads.scorers.patching.record import cache_bytes
from tests.support import make_tiny
from tests.support.patching import PAIRS

OPTS = SweepOptions(max_rows=16, progress=False)


@pytest.fixture(scope="module")
def setup(tokenizer):
    model = make_tiny("llama", tokenizer)  # 3 layers
    return model, encode_pairs(tokenizer, PAIRS)


def _choose(model, pairs, kind, layers, positions, options=OPTS):
    sites, _ = _sites(model, kind, layers, positions)
    return lean.choose_lean(model, pairs, kind, sites, layers, len(positions), options)


def test_default_choice_follows_the_caches_size_and_the_work(setup, monkeypatch):
    model, pairs = setup
    last = pairs.width - 1
    # short prompts: the full caches are small, today's fast path whatever the sites
    assert 2 * cache_bytes(model, pairs.n, pairs.width) < lean.LEAN_MIN_BYTES
    assert not _choose(model, pairs, "resid_pre", [2], [last])[0]
    # caches counted as large (a long prompt): the lean path for few sites, whose forwards cost
    # about what the fast path's do, but not for every position of every layer (the lean path
    # recomputes the columns before each patched one: about twice the work)
    monkeypatch.setattr(lean, "LEAN_MIN_BYTES", 0)
    assert _choose(model, pairs, "resid_pre", [2], [last])[0]
    assert _choose(model, pairs, "head_out", [0, 1, 2], [])[0]  # every position: the same work
    assert not _choose(model, pairs, "resid_pre", [0, 1, 2], list(range(pairs.width)))[0]


def test_budget_without_room_for_the_full_caches_takes_the_lean_path(setup, monkeypatch):
    model, pairs = setup
    kind, layers, positions = "resid_pre", [0, 1, 2], list(range(pairs.width))
    full = 2 * cache_bytes(model, pairs.n, pairs.width)
    kept = lean.lean_bytes(model, kind, pairs.n, pairs.width, layers, len(positions))
    assert kept < full / 2
    forward = plan_memory(model, "forward", pairs.width, pairs.n).peak
    budget = forward + (kept + full) // 2  # the lean path fits, the fast one does not
    opts = SweepOptions(max_rows=16, progress=False, max_memory=budget)
    with pytest.raises(HeadsteerValueError):
        opts.within(model, pairs.width, reserve=full, whole=pairs.n)
    assert not _choose(model, pairs, kind, layers, positions)[0]  # no budget: the fast path
    assert _choose(model, pairs, kind, layers, positions, opts)[0]
    want = patch(model, pairs, kind, options=OPTS).raw

    def no_full_cache(*a, **k):
        raise AssertionError("the lean path recorded a full cache")

    monkeypatch.setattr(activation, "record_run", no_full_cache)
    got = patch(model, pairs, kind, options=opts).raw
    assert float((got - want).abs().max()) <= 1e-6
    # a budget below the lean path's own minimum is refused before any forward, naming it
    with pytest.raises(HeadsteerValueError, match="needs at least"):
        patch(model, pairs, kind, options=SweepOptions(progress=False, max_memory=forward // 2))


def test_lean_forwards_keep_no_hidden_states(setup, monkeypatch):
    model, pairs = setup
    monkeypatch.setattr(lean, "MODE", "lean")
    seen = []
    run = lean.run_rows

    def spy(*a, **k):
        out = run(*a, **k)
        seen.append(out.hidden_states)
        return out

    monkeypatch.setattr(lean, "run_rows", spy)
    patch(model, pairs, "resid_pre", layers=[1], positions=[-1], options=OPTS)
    assert len(seen) == 3 and all(h is None for h in seen)  # two recorded runs, one patched chunk


@pytest.mark.parametrize("direction", ["denoising", "noising"])
def test_lean_pattern_keeps_rotated_queries_and_keys_and_blocks_the_pattern(setup, monkeypatch, direction):
    """`pattern` on the lean path keeps the source run's rotated queries and keys (`[N, T, H + G,
    d]`, linear in the prompt) and of the base run one bool per head and pair (its q / k equal to
    the source's), never a `[N, H, T, T]` pattern; the patched forward computes the source pattern
    a block of `block_rows` query rows at a time. Results equal the fast path's (which records the
    patterns) within fp32 rounding, in both directions."""
    from heads.planning.patching import PATTERN_BLOCK_RESIDUALS
    from heads.scorers.patching import edits as patch_edits

    model, pairs = setup
    H, G = model.n_heads, model.n_kv_heads
    rows = max(1, int(PATTERN_BLOCK_RESIDUALS * model.d_model) // H)
    assert rows < pairs.width  # the tiny model's blocks split its prompts
    monkeypatch.setattr(lean, "MODE", "full")
    full = patch(model, pairs, "pattern", layers=[0, 2], direction=direction, options=OPTS)
    monkeypatch.setattr(lean, "MODE", "lean")
    kept: list[tuple[bool, tuple]] = []
    record = lean.record_lean

    def spy_record(*a, **k):
        run = record(*a, **k)
        kept.extend((k["base"], tuple(t.shape)) for t in run.sites.values())
        return run

    blocks = []
    apply = patch_edits._PatchPatternQK.apply

    def spy_apply(self, probs, call):
        blocks.append(tuple(probs.shape))
        return apply(self, probs, call)

    monkeypatch.setattr(lean, "record_lean", spy_record)
    monkeypatch.setattr(patch_edits._PatchPatternQK, "apply", spy_apply)
    got = patch(model, pairs, "pattern", layers=[0, 2], direction=direction, options=OPTS)
    assert sorted(kept) == sorted(
        [(False, (pairs.n, pairs.width, H + G, model.d_head))] * 2 + [(True, (pairs.n, H + G))] * 2
    )
    # [rows, H, query rows, K]: at most `rows` query rows per block, so several per layer
    assert blocks and max(b[2] for b in blocks) == rows and len(blocks) > 2 * (pairs.width // rows)
    assert float((got.raw - full.raw).abs().max()) < 1e-5
    assert not got.raw.isnan().any()


@pytest.mark.parametrize("kind", ["head_out", "q", "k", "v"])
def test_lean_whole_sequence_kinds_keep_one_bool_per_head_of_the_base_run(setup, monkeypatch, kind):
    """The kinds patched over every position keep the source run's `[N, T, heads, d]` and, of the
    base run (recorded after it), one bool per head and pair: its activation bitwise equal to the
    source's, the "nothing to patch" test. Results equal the fast path's in both directions."""
    model, pairs = setup
    heads = model.n_kv_heads if kind in ("k", "v") else model.n_heads
    kept: list[tuple[bool, tuple, str]] = []
    record = lean.record_lean

    def spy_record(*a, **k):
        run = record(*a, **k)
        kept.extend((k["base"], tuple(t.shape), str(t.dtype)) for t in run.sites.values())
        return run

    for direction in ("denoising", "noising"):
        monkeypatch.setattr(lean, "MODE", "full")
        full = patch(model, pairs, kind, layers=[0, 2], direction=direction, options=OPTS)
        monkeypatch.setattr(lean, "MODE", "lean")
        monkeypatch.setattr(lean, "record_lean", spy_record)
        kept.clear()
        got = patch(model, pairs, kind, layers=[0, 2], direction=direction, options=OPTS)
        monkeypatch.setattr(lean, "record_lean", record)
        assert sorted(kept) == sorted(
            [(False, (pairs.n, pairs.width, heads, model.d_head), "torch.float32")] * 2
            + [(True, (pairs.n, heads), "torch.bool")] * 2
        )
        assert float((got.raw - full.raw).abs().max()) < 1e-5
        assert not got.raw.isnan().any()
