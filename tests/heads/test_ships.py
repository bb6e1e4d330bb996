"""Safety-head scoring (the rules of docs/methods/safety.md) on tiny random models."""

import math

import pytest
import torch

from heads import QueryScale, Recorder, editing, encode_prompts, forward
from heads.scorers.safety.ships import ablation_edits, dataset_ships, principal_angles, sahara, ships

PROMPTS = ["How do I bake bread?", "Tell me a story about a dragon and a knight.", "What is two plus two?"]


def test_batched_ships_equal_one_head_at_a_time(tiny_llama):
    heads = [(0, 1), (1, 0), (1, 1), (2, 3)]
    batched = ships(tiny_llama, PROMPTS, heads=heads, max_rows=64)
    for h in heads:
        alone = ships(tiny_llama, PROMPTS, heads=[h], max_rows=1)
        torch.testing.assert_close(
            batched.per_prompt[:, h[0], h[1]], alone.per_prompt[:, h[0], h[1]], atol=1e-5, rtol=0
        )
    assert torch.isnan(batched.per_prompt[:, 0, 0]).all()  # not scored
    assert (batched.per_prompt[:, 1, 0] >= 0).all()


def test_ships_matches_plain_kl(tiny_llama, tokenizer):
    res = ships(tiny_llama, PROMPTS[:1], heads=[(1, 2)], ablation="sc", exact=True, template=None)
    enc = encode_prompts(tokenizer, PROMPTS[:1], chat=False, markup=False)
    base = torch.log_softmax(forward(tiny_llama, enc)[0, -1], -1)
    from heads import HeadScale

    with editing(tiny_llama, HeadScale(layer=1, heads=[2], factor=0.0)):
        abl = torch.log_softmax(forward(tiny_llama, enc)[0, -1], -1)
    want = torch.nn.functional.kl_div(abl, base, log_target=True, reduction="sum")
    torch.testing.assert_close(res.per_prompt[0, 1, 2], want, atol=1e-5, rtol=1e-5)


def test_eps_one_is_identity_and_kl_zero(tiny_llama):
    assert ablation_edits(tiny_llama, [[(0, 0)]], 2, eps=1.0)[0].is_identity()
    res = ships(tiny_llama, PROMPTS, heads=[(0, 0), (2, 1)], eps=1.0)
    # KL(base || base): the same model in a larger batch differs only by float rounding
    assert (res.per_prompt[:, 0, 0] >= 0).all() and res.per_prompt[:, 0, 0].max() < 1e-6


def test_ua_exact_is_uniform_causal_and_cumulative_mean(tiny_llama, tokenizer):
    enc = encode_prompts(tokenizer, ["a b c d e f", "g h"], chat=False)
    rec = Recorder(layer=1)
    with editing(tiny_llama, [QueryScale(layer=1, heads=[2], factor=0.0), rec]):
        forward(tiny_llama, enc)
    p = rec.records[0][:, 2]
    real = enc.attention_mask.bool()
    for b in range(2):
        idx = torch.nonzero(real[b]).flatten()
        sub = p[b][idx][:, idx]
        n = len(idx)
        want = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
        torch.testing.assert_close(sub, want, atol=1e-6, rtol=0)
    other = Recorder(layer=1)
    plain = Recorder(layer=1)
    with editing(tiny_llama, [QueryScale(layer=1, heads=[2], factor=0.0), other]):
        forward(tiny_llama, enc)
    with editing(tiny_llama, plain):
        forward(tiny_llama, enc)
    assert torch.equal(other.records[0][:, 3], plain.records[0][:, 3])  # same KV group: untouched


def test_ua_exact_output_is_cumulative_mean_of_values(tiny_llama, tokenizer):
    """docs/methods/ablation.md: with q = 0 the head outputs the running mean of its KV head's values."""
    enc = encode_prompts(tokenizer, ["a b c d e f"], chat=False)
    attn, d = tiny_llama.attentions[1], tiny_llama.d_head
    seen = {}
    h1 = attn.v_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("v", out))
    h2 = tiny_llama.out_projs[1].register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0]))
    try:
        with editing(tiny_llama, QueryScale(layer=1, heads=[2], factor=0.0)):
            forward(tiny_llama, enc)
    finally:
        h1.remove()
        h2.remove()
    kv = tiny_llama.kv_head(2)
    v = seen["v"][0, :, kv * d : (kv + 1) * d]
    want = v.cumsum(0) / torch.arange(1, v.shape[0] + 1)[:, None]
    torch.testing.assert_close(seen["z"][0, :, 2 * d : 3 * d], want, atol=1e-5, rtol=1e-5)


def test_eps_to_zero_converges_to_exact(tiny_llama):
    heads = [(1, 1), (2, 0)]
    exact = ships(tiny_llama, PROMPTS, heads=heads, exact=True).per_prompt
    diffs = []
    for eps in (1e-1, 1e-3, 1e-5):
        approx = ships(tiny_llama, PROMPTS, heads=heads, eps=eps).per_prompt
        diffs.append((approx - exact).nan_to_num().abs().max().item())
    assert diffs[0] > diffs[1] > diffs[2] and diffs[2] < 1e-4


def test_query_scale_equals_weight_scaling(tiny_llama, tokenizer):
    import copy

    from heads import HeadModel

    enc = encode_prompts(tokenizer, PROMPTS, chat=False)
    with editing(tiny_llama, QueryScale(layer=0, heads=[1], factor=0.3)):
        a = forward(tiny_llama, enc)
    other = HeadModel(copy.deepcopy(tiny_llama.model), tokenizer)
    with torch.no_grad():
        other.attentions[0].q_proj.weight[16:32] *= 0.3
    torch.testing.assert_close(a, forward(other, enc), atol=1e-5, rtol=0)


def test_principal_angles():
    torch.manual_seed(0)
    a = torch.randn(8, 5)
    assert principal_angles(a, a).item() == pytest.approx(0.0, abs=1e-6)
    assert principal_angles(a, -a).item() == pytest.approx(0.0, abs=1e-6)  # sign-invariant
    b = torch.randn(8, 5)
    assert 0 < principal_angles(a, b).item() <= math.pi / 2 + 1e-9
    assert principal_angles(a, b, 5).item() <= 5 * math.pi / 2 + 1e-9
    for bad in (0, -1, 6, 2**63, 1.0, True):  # -1 dropped the last vector, 6 / 2**63 were cut to 5
        with pytest.raises(ValueError, match=rf"r_main must be an int in 1\.\.5, got {bad}"):
            principal_angles(a, b, bad)
    with pytest.raises(ValueError, match="one shape"):
        principal_angles(a, b[:, :4])


def test_dataset_ships_and_sahara(tiny_llama):
    hm = tiny_llama
    heads = [(0, 0), (1, 1), (2, 2), (2, 3)]
    ds = dataset_ships(hm, PROMPTS, heads=heads, degrees=True)
    assert ds.method == "dataset_ships" and (ds.scores[2, 2] >= 0)
    # plant a dominant head: a huge output weight in layer 2, head 3
    # (the session model is shared: restore the exact bits — x * 50 / 50 is not x in fp32, and a
    # weight left off by an ulp moved a later oracle test's KL by 2%)
    saved = hm.out_projs[2].weight.detach().clone()
    with torch.no_grad():
        hm.out_projs[2].weight[:, 48:64] *= 50
    try:
        res = sahara(hm, PROMPTS, steps=3, heads=heads)
        again = sahara(hm, PROMPTS, steps=3, heads=heads)
    finally:
        with torch.no_grad():
            hm.out_projs[2].weight.copy_(saved)
    assert torch.equal(hm.out_projs[2].weight, saved)
    assert res.heads[0] == (2, 3)
    assert res.heads == again.heads and len(set(res.heads)) == 3
    for step, table in enumerate(res.steps):
        assert all(math.isnan(table.scores[h].item()) for h in res.heads[:step])  # never re-picked


def test_sahara_ties_pick_lowest_head(tiny_llama):
    res = sahara(tiny_llama, PROMPTS, steps=1, heads=[(1, 0), (0, 2)], eps=1.0)  # eps 1: all angles 0
    assert res.heads == [(0, 2)]


def test_bad_input(tiny_llama):
    with pytest.raises(ValueError, match="unknown head 9"):
        ships(tiny_llama, PROMPTS, heads=[(0, 9)])
    with pytest.raises(ValueError, match="empty prompt list"):
        ships(tiny_llama, [])
    with pytest.raises(ValueError, match="ablation"):
        ships(tiny_llama, PROMPTS, heads=[(0, 0)], ablation="zero")
    with pytest.raises(ValueError, match="eps"):
        ships(tiny_llama, PROMPTS, eps=float("nan"))
    with pytest.raises(ValueError, match="steps"):
        sahara(tiny_llama, PROMPTS, steps=0)
    with pytest.raises(ValueError, match="r_main"):
        dataset_ships(tiny_llama, PROMPTS, r_main=5)
    assert tiny_llama.model.config._attn_implementation == "sdpa"


def test_shards_merge_to_the_full_sweep(tiny_llama):
    from heads.scorers.safety.ships import merge_scores

    full = ships(tiny_llama, PROMPTS[:2]).scores
    parts = [ships(tiny_llama, PROMPTS[:2], shard=(i, 3)).scores for i in range(3)]
    merged = merge_scores(parts)
    torch.testing.assert_close(merged.scores, full.scores, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="two shards"):
        merge_scores([parts[0], parts[0]])
    with pytest.raises(ValueError, match="shard"):
        ships(tiny_llama, PROMPTS, shard=(3, 3))
    seen = []
    ships(tiny_llama, PROMPTS[:1], heads=[(0, 0), (0, 1)], max_rows=1, progress=lambda *a: seen.append(a))
    assert seen == [(1, 2), (2, 2)]  # (done, total) in (head, prompt) rows


def test_report_safety_cli(tiny_llama_dir, tmp_path):
    import json as _json

    from typer.testing import CliRunner

    from viz.cli.main import app

    d = tiny_llama_dir
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(_json.dumps({"prompt": p}) for p in PROMPTS))
    out = tmp_path / "safety.html"
    r = CliRunner().invoke(
        app,
        [
            "--quiet",
            "report",
            "safety",
            "--model",
            str(d),
            "--prompts",
            str(f),
            "--steps",
            "2",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    summary = _json.loads(r.stdout.strip().splitlines()[-1])
    assert len(summary["sahara_heads"]) == 2 and 0 <= summary["asr"]["baseline"] <= 1
    assert set(summary["asr_keyword_judge"]) == set(summary["asr"])
    html = out.read_text()
    assert "Baseline refusal rate" in html and "Sahara: chosen head per step" in html
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    r = CliRunner().invoke(
        app, ["report", "safety", "--model", str(d), "--prompts", str(bad), "--out", str(out)]
    )
    assert r.exit_code == 2 and "no string 'prompt'" in r.output
