"""PASTA head profiling (docs/methods/pasta.md) on tiny random models."""

import json

import pytest
import torch

from heads import HeadScores, HeadSet, editing, encode_prompts, forward
from steer.pasta.method import Pasta
from steer.pasta.profiling import profile_heads, select_heads, smallest_k, target_ids

PROMPTS = [
    "Alice is a nurse in Leeds. She likes chess and rowing. **Answer in JSON.** Now",
    "Bob works as a pilot. **Reply in one word.** He also sings in a choir on Sundays",
    "**Be brief.** Carol repairs bicycles in a small shop near the harbour",
]
TARGETS = [" {", " Pilot", " She"]
HEADS = [(0, 1), (1, 0), (1, 3), (2, 2)]


def _oracle(hm, heads):
    """One plain forward per head with `Pasta` on that head alone: mean log-prob change."""
    enc = encode_prompts(hm.tokenizer, PROMPTS, chat=False)
    tgt = target_ids(hm.tokenizer, TARGETS)
    base = torch.log_softmax(forward(hm, enc)[:, -1].float(), -1).gather(1, tgt[:, None])[:, 0]
    out = {}
    for h in heads:
        with editing(hm, Pasta(heads=[h]).edits(hm, enc)):
            lp = torch.log_softmax(forward(hm, enc)[:, -1].float(), -1).gather(1, tgt[:, None])[:, 0]
        out[h] = (lp - base).mean().item()
    return out


@pytest.mark.parametrize("reuse", [True, False])
def test_batched_profile_equals_one_head_at_a_time(tiny_llama, reuse):
    prof = profile_heads(
        tiny_llama, PROMPTS, TARGETS, heads=HEADS, chat=False, reuse_positions=reuse, max_rows=3
    )
    want = _oracle(tiny_llama, HEADS)
    for (layer, head), value in want.items():
        assert prof.scores[layer, head].item() == pytest.approx(value, abs=1e-5)
    alone = profile_heads(tiny_llama, PROMPTS, TARGETS, heads=HEADS, chat=False, max_rows=1)
    torch.testing.assert_close(prof.scores, alone.scores, atol=1e-5, rtol=0, equal_nan=True)
    assert torch.isnan(prof.scores[0, 0]) and any(abs(v) > 1e-4 for v in want.values())


def test_position_reuse_equals_full_prefill_on_gpt2(tokenizer, monkeypatch):
    import heads.engine.variants as variants
    from tests.support import make_tiny

    hm = make_tiny("gpt2", tokenizer)
    heads = [(0, 0), (1, 1)]
    widths = []
    real = variants._forward
    monkeypatch.setattr(
        variants, "_forward", lambda m, ids, *a, **k: widths.append(ids.shape[1]) or real(m, ids, *a, **k)
    )
    a = profile_heads(hm, PROMPTS, TARGETS, heads=heads, chat=False, reuse_positions=True, max_rows=2)
    reused = list(widths)
    b = profile_heads(hm, PROMPTS, TARGETS, heads=heads, chat=False, reuse_positions=False, max_rows=2)
    torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=0, equal_nan=True)
    assert sum(reused) < sum(widths[len(reused) :])  # fewer positions were run with reuse


def test_select_heads_and_profile_round_trip(tiny_llama, tmp_path):
    t = torch.zeros(4, 4)
    a = HeadScores(
        t.clone().index_put_((torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])), torch.tensor([3.0, 2, 1])),
        "pasta_profile",
    )
    b = HeadScores(
        t.clone().index_put_((torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])), torch.tensor([3.0, 2, 1])),
        "pasta_profile",
    )
    profiles = {"a": a, "b": b}
    assert select_heads(profiles, 3) == HeadSet([(1, 1), (2, 2)])
    assert select_heads(profiles, 3, mode="union") == HeadSet([(0, 0), (1, 1), (2, 2), (3, 3)])
    assert select_heads(profiles, 1, mode="task", task="b") == HeadSet([(1, 1)])
    path = select_heads(profiles, 3).save(tmp_path / "profile.json")
    assert json.loads(path.read_text()) == {"1": [1], "2": [2]}
    assert Pasta(heads=str(path)).head_set(tiny_llama) == HeadSet([(1, 1), (2, 2)])
    with pytest.raises(ValueError, match="mode"):
        select_heads(profiles, 3, mode="vote")
    with pytest.raises(ValueError, match="task"):
        select_heads(profiles, 3, mode="task", task="c")
    with pytest.raises(ValueError, match="non-empty"):
        select_heads({}, 3)


def test_profile_bad_input(tiny_llama):
    with pytest.raises(ValueError, match="targets"):
        profile_heads(tiny_llama, PROMPTS, TARGETS[:2], chat=False)
    with pytest.raises(ValueError, match="no emphasized span"):
        profile_heads(tiny_llama, ["no span here"], [" x"], chat=False)
    with pytest.raises(ValueError, match="alpha"):
        profile_heads(tiny_llama, PROMPTS, TARGETS, chat=False, alpha=0.0)
    with pytest.raises(ValueError, match="unknown layer"):
        profile_heads(tiny_llama, PROMPTS, TARGETS, chat=False, heads=[(99, 0)])
    with pytest.raises(ValueError, match="max_rows"):
        profile_heads(tiny_llama, PROMPTS, TARGETS, chat=False, max_rows=0)


def _brute_smallest_k(profiles, n_heads, mode):
    """Oracle: scan k = 1, 2, ... with plain top-k sets (the rule the CLI used before)."""
    for k in range(1, 10_000):
        tops = [set(p.ranked(k)) for p in profiles.values()]
        chosen = set.intersection(*tops) if mode == "intersection" else set.union(*tops)
        if len(chosen) >= n_heads:
            return k, chosen
    raise AssertionError("no k")


@pytest.mark.parametrize("mode", ["intersection", "union"])
def test_select_heads_n_heads_is_the_smallest_k_rule(mode):
    g = torch.Generator().manual_seed(0)
    profiles = {
        t: HeadScores(torch.randint(0, 5, (4, 6), generator=g).float(), "pasta_profile") for t in "abc"
    }  # many ties, so one more k can add several heads
    profiles["a"].scores[0, 0] = float("nan")  # not profiled: never in an intersection
    for n in range(1, 24):
        k, chosen = _brute_smallest_k(profiles, n, mode)
        assert smallest_k(profiles, n, mode=mode) == k
        got = select_heads(profiles, n_heads=n, mode=mode)
        assert got == HeadSet(chosen) == select_heads(profiles, k, mode=mode)
        assert len(got) >= n and (k == 1 or len(select_heads(profiles, k - 1, mode=mode)) < n)
    assert (0, 0) not in select_heads(profiles, n_heads=23, mode="intersection")
    with pytest.raises(ValueError, match="at most 23 heads"):
        select_heads(profiles, n_heads=24, mode="intersection")  # 24 heads, one NaN in task a
    assert len(select_heads(profiles, n_heads=24, mode="union")) == 24
    with pytest.raises(ValueError, match="exactly one of k and n_heads"):
        select_heads(profiles, 3, n_heads=3)
    with pytest.raises(ValueError, match="exactly one of k and n_heads"):
        select_heads(profiles)
    with pytest.raises(ValueError, match="positive"):
        select_heads(profiles, n_heads=0)


def test_profile_progress_is_rows_done_of_total(tiny_llama):
    seen = []
    profile_heads(
        tiny_llama, PROMPTS, TARGETS, heads=HEADS, chat=False, max_rows=5, progress=lambda *a: seen.append(a)
    )
    assert [t for _, t in seen] == [len(HEADS) * len(PROMPTS)] * len(seen)
    done = [d for d, _ in seen]
    steps = [b - a for a, b in zip([0, *done], done, strict=False)]
    assert done[-1] == len(HEADS) * len(PROMPTS) and all(0 < s <= 5 for s in steps)  # max_rows=5 per batch


def test_select_heads_reads_role_scores_without_the_dict_warning():
    """The detectors' `RoleScores` is a valid `profiles` mapping: selecting from it gives what the
    plain dict gives and raises no deprecation warning from inside the library."""
    import warnings

    from heads.results.roles import RoleScores

    t = torch.arange(12.0).view(3, 4)
    plain = {
        "induction": HeadScores(t, "induction", {}, "m", 4),
        "prev": HeadScores(t.flip(1), "prev", {}, "m", 4),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        got = select_heads(RoleScores(plain), 2, mode="union")
    assert got == select_heads(plain, 2, mode="union") and len(got) == 4  # two disjoint top-2s
