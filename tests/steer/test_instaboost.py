"""InstABoost against the reference's rule, re-implemented from its lines as an oracle.

Reference: BrachioLab/InstABoost, src/steering.py (commit 4eba248), lines 66-74,
`prompt_attention_ablation_hook`: on `hook_pattern` of every layer (lines 330 and 395: one hook
per layer, all heads), `attn_scores[:, :, :, :prompt_len] *= multiplier`, then
`torch.nn.functional.normalize(attn_scores, p=1, dim=-1)`; `prompt_len` (line 313) is the token
length of the prepended instruction prompt. `_reference_hook` below re-states those two lines for
a column set G; the eager oracle (`tests.support.oracle.llama_forward`) applies it in every layer.
"""

import math
import warnings

import pytest
import torch

from heads import editing, encode_prompts, forward
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from steer import InstaBoost, Pasta, SteeredModel
from steer.instaboost import instaboost_column_bias
from steer.noop import NoOpWarning
from tests.support.oracle import llama_forward

PROMPTS = [
    "Context: the sky is green today. **Answer in one word.** What colour is the sky?",
    "Note: **the key is under the mat.** Where is the key?",
]
ALL = [0, 1, 2]  # the tiny model's layers: PASTA on all heads


def _reference_hook(probs: torch.Tensor, g: torch.Tensor, multiplier: float) -> torch.Tensor:
    """The reference's two lines on a `[B, H, T, K]` pattern, for a `[B, K]` bool column set G."""
    out = probs.clone()
    out = torch.where(g[:, None, None, :], out * multiplier, out)
    return torch.nn.functional.normalize(out, p=1, dim=-1)


def _steered(hm, enc, steer, kernel="auto"):
    with editing(hm, [e for s in steer for e in s.edits(hm, enc)], kernel=kernel):
        return forward(hm, enc)


@pytest.fixture()
def enc(tokenizer):
    return encode_prompts(tokenizer, PROMPTS, chat=False)


@pytest.mark.parametrize("kernel", ["blocked", "fused"])
def test_equals_reference_hook_in_every_layer(tiny_llama, enc, kernel):
    m = 7.0
    g = enc.span_mask()
    want = llama_forward(
        tiny_llama.model, enc.input_ids, enc.attention_mask, lambda la, p: _reference_hook(p, g, m)
    )
    got = _steered(tiny_llama, enc, [InstaBoost(multiplier=m)], kernel=kernel)
    real = enc.attention_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    base = forward(tiny_llama, enc)
    assert float((got[real] - base[real]).abs().max()) > 1e-2  # it does steer


def test_prefix_region_is_the_references_prompt_len(tokenizer, tiny_llama):
    """`region="prefix"` boosts [first token, end of the instruction): the reference's `:prompt_len`
    for an instruction prepended to the query (steering.py line 334: `steer_prompt + sample`)."""
    instruction = "Always answer in French."
    enc = encode_prompts(tokenizer, [f"**{instruction}** What colour is the sky?"], chat=False)
    prompt_len = len(tokenizer(instruction, add_special_tokens=False).input_ids)
    cb = instaboost_column_bias(enc, 3.0, "prefix")
    assert cb[0, :prompt_len].eq(math.log(3.0)).all() and not cb[0, prompt_len:].any()
    g = torch.zeros(1, enc.length, dtype=torch.bool)
    g[0, :prompt_len] = True
    want = llama_forward(
        tiny_llama.model, enc.input_ids, enc.attention_mask, lambda la, p: _reference_hook(p, g, 3.0)
    )
    got = _steered(tiny_llama, enc, [InstaBoost(multiplier=3.0, region="prefix")])
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)


def test_prefill_equals_pasta_on_all_heads_with_alpha_one_over_m(tiny_llama, enc):
    m = 9.0
    got = _steered(tiny_llama, enc, [InstaBoost(multiplier=m)])
    pasta = _steered(tiny_llama, enc, [Pasta(ALL, alpha=1 / m)])
    real = enc.attention_mask.bool()
    torch.testing.assert_close(got[real], pasta[real], atol=1e-5, rtol=0)


def test_decoding_equals_pasta_exclude_plus_generation_and_differs_from_pasta(tiny_llama):
    """Generated columns: InstABoost leaves them unboosted; PASTA treats them like the span."""
    m = 9.0
    sm = SteeredModel(tiny_llama)
    kw = dict(max_new_tokens=6, chat=False, return_dict_in_generate=True, output_scores=True)
    boost = sm.generate(PROMPTS, [InstaBoost(multiplier=m)], **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoOpWarning)  # alpha > 1 in generation mode is intended here
        both = sm.generate(
            PROMPTS, [Pasta(ALL, alpha=1 / m), Pasta(ALL, alpha=m, scale_position="generation")], **kw
        )
    pasta = sm.generate(PROMPTS, [Pasta(ALL, alpha=1 / m)], **kw)
    assert boost.token_ids == both.token_ids
    for a, b in zip(boost.outputs.scores, both.outputs.scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # first token: prefill only, equal to PASTA; later steps see generated columns and differ
    torch.testing.assert_close(boost.outputs.scores[0], pasta.outputs.scores[0], atol=1e-4, rtol=0)
    pairs = zip(boost.outputs.scores[1:], pasta.outputs.scores[1:], strict=True)
    later = max(float((a - b).abs().max()) for a, b in pairs)
    assert later > 1e-3


def test_cache_and_no_cache_generate_the_same(tiny_llama):
    sm = SteeredModel(tiny_llama)
    a = sm.generate(PROMPTS, [InstaBoost(multiplier=15.0)], max_new_tokens=6, chat=False)
    b = sm.generate(PROMPTS, [InstaBoost(multiplier=15.0)], max_new_tokens=6, chat=False, use_cache=False)
    assert a.token_ids == b.token_ids


def test_identity_and_bad_input(tiny_llama, enc):
    with pytest.warns(NoOpWarning, match="no-op"):
        ident = InstaBoost(multiplier=1.0)
    assert ident.edits(tiny_llama, enc) == []
    with pytest.warns(NoOpWarning, match="suppresses"):
        InstaBoost(multiplier=0.5)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e5):
        with pytest.raises(HeadsteerValueError, match="multiplier"):
            InstaBoost(multiplier=bad)
    with pytest.raises(HeadsteerTypeError, match="multiplier"):
        InstaBoost(multiplier="3")  # type: ignore[arg-type]
    with pytest.raises(HeadsteerValueError, match="region"):
        InstaBoost(region="all")  # type: ignore[arg-type]
    with pytest.raises(HeadsteerValueError, match=r"layer\(s\) \[7\]"):
        InstaBoost(layers=(0, 7)).edits(tiny_llama, enc)
    plain = encode_prompts(tiny_llama.tokenizer, ["no span here"], chat=False)
    with pytest.raises(HeadsteerValueError, match="emphasized span"):
        InstaBoost().edits(tiny_llama, plain)


def test_served_in_a_batch_equals_generate_alone(tiny_llama):
    """The server's `steer` field: an InstABoost request batched with an unsteered one."""
    from steer.serving import BatchGenerator, SamplingParams, ServeRequest, parse_steer

    prompt = "Read this: the key is blue. **Answer in one word.** What is the key?"
    spec = [{"method": "instaboost", "multiplier": 9}]
    gen = BatchGenerator(tiny_llama)
    greedy = SamplingParams(max_tokens=5, temperature=0)
    reqs = [
        ServeRequest(prompt, True, parse_steer(spec), params=greedy),
        ServeRequest("hi", True, [], params=greedy),
    ]
    served = gen.run([gen.prepare(r) for r in reqs])
    sm = SteeredModel(tiny_llama)
    alone = sm.generate(prompt, [InstaBoost(multiplier=9.0)], max_new_tokens=5, chat=True)
    assert served[0].token_ids == alone.token_ids[0]
    for bad, match in (
        ({"method": "instaboost", "multiplier": 0}, "multiplier"),
        ({"method": "instaboost", "region": "all"}, "region"),
        ({"method": "instaboost", "multiplier": 1}, "no-op"),
        ({"method": "instaboost", "heads": "auto"}, "unknown field"),
    ):
        with pytest.raises(HeadsteerValueError, match=match):
            parse_steer([bad])


def test_cli_generate_and_eval(tiny_llama_dir, tmp_path):
    """`headsteer generate --steer instaboost` and `headsteer eval --method instaboost`."""
    import json

    from typer.testing import CliRunner

    from viz.cli.main import app

    runner = CliRunner()
    args = ["generate", "Context: sky. **Answer in one word.** Colour?", "--steer", "instaboost"]
    args += ["--model", tiny_llama_dir, "--max-new-tokens", "2", "--multiplier", "9", "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["multiplier"] == 9
    r = runner.invoke(app, [*args[:-1], "--alpha", "0.1"])
    assert r.exit_code == 2 and "--alpha is not used by --steer instaboost" in r.output
    r = runner.invoke(app, ["generate", "x **y**", "--multiplier", "3", "--model", tiny_llama_dir])
    assert r.exit_code == 2 and "--multiplier is not used by --steer pasta" in r.output
    out = tmp_path / "r.csv"
    ev = ["eval", "--method", "instaboost", "--task", "counterfact", "--limit", "3"]
    ev += ["--model", tiny_llama_dir]
    r = runner.invoke(app, [*ev, "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    import pandas as pd

    table = pd.read_csv(out)
    assert table.method.tolist() == ["instaboost"] and table.n.tolist() == [3]
    r = runner.invoke(app, [*ev, "--multiplier", "0", "--out", str(tmp_path / "b.csv")])
    assert r.exit_code == 2 and "multiplier" in r.output and "loading" not in r.output
