"""`headsteer report patching` and `viz.reports.patching` on tiny models; DLA / lens on other backends."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from heads import HeadModel
from heads.errors import HeadsteerValueError
from heads.scorers.patching.logit import direct_logit_attribution, logit_lens
from heads.scorers.patching.pairs import encode_pairs
from probes.datasets.pairs import load_task_pairs
from tests.support import make_tiny
from viz.cli.main import app
from viz.reports.patching import patching_report


def test_report_page(tmp_path, tiny_llama):
    out = tmp_path / "p.html"
    pairs = load_task_pairs("ioi", n=3)
    _, summary = patching_report(tiny_llama, out, pairs, site="resid_pre", progress=False, task="ioi")
    page = out.read_text(encoding="utf-8")
    for heading in (
        "patching scores by position",
        "direct logit attribution by layer",
        "logit lens",
        "top sites",
    ):
        assert heading in page
    assert summary["pairs"] == 3 and summary["site"] == "resid_pre" and len(summary["top"]) == 5
    with pytest.raises(ValueError, match="exists"):
        patching_report(tiny_llama, out, pairs, progress=False)
    with pytest.raises(ValueError, match="unknown patching kind"):
        patching_report(tiny_llama, tmp_path / "q.html", pairs, site="nope", progress=False)


def test_report_page_of_the_attribution_estimate(tmp_path, tiny_llama):
    from heads.scorers.patching.request import PatchRequest

    out = tmp_path / "a.html"
    request = PatchRequest(kind="head_out", method="attribution")
    patching_report(tiny_llama, out, load_task_pairs("ioi", n=2), request=request, progress=False)
    assert "Attribution patching (first-order estimate): head_out" in out.read_text(encoding="utf-8")


def test_cli_report_patching(tiny_llama_dir, tmp_path):
    out = tmp_path / "p.html"
    r = CliRunner().invoke(
        app, ["report", "patching", "--out", str(out), "--model", tiny_llama_dir, "--n", "2", "--json"]
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["site"] == "head_out" and data["pairs"] == 2 and out.is_file()
    assert "patching scores per head" in out.read_text(encoding="utf-8")
    # a pairs file works too
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(p.to_dict()) + "\n" for p in load_task_pairs("colored_objects", n=2)))
    r = CliRunner().invoke(
        app, ["report", "patching", "--out", str(tmp_path / "c.html"), "--model", tiny_llama_dir,
              "--task", str(f), "--kind", "mlp_out", "--json"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    # bad options: one line, exit 2, before the model loads (the model path does not exist)
    for args, word in (
        (["--kind", "nope"], "--kind"),
        (["--site", "nope"], "--site"),  # the old name, one release
        (["--direction", "up"], "--direction"),
        (["--task", "nope"], "nope"),
        (["--n", "0"], "--n"),
        (["--split", "dev"], "dev"),
    ):
        r = CliRunner().invoke(
            app, ["report", "patching", "--out", str(tmp_path / "x.html"), "--model", "/no/model", *args]
        )
        assert r.exit_code == 2 and word in r.output, (args, r.output)


def _bridge(model, tokenizer):
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers("tiny", hf_model=model, tokenizer=tokenizer)


def test_dla_and_lens_on_the_transformer_lens_and_nnsight_backends(tokenizer):
    from nnsight.modeling.transformers import TransformersModel

    hf = make_tiny("llama", tokenizer)
    pairs = encode_pairs(hf, load_task_pairs("ioi", n=2))
    want, lens = direct_logit_attribution(hf, pairs), logit_lens(hf, pairs)
    for other in (
        HeadModel.wrap(_bridge(make_tiny("llama", tokenizer).model, tokenizer), tokenizer),
        HeadModel.wrap(
            TransformersModel(make_tiny("llama", tokenizer).model, tokenizer=tokenizer), tokenizer
        ),
    ):
        got = direct_logit_attribution(other, pairs)
        torch.testing.assert_close(got.heads, want.heads, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.total()[:, -1], want.logit_diff[:, -1], atol=1e-5, rtol=0)
        torch.testing.assert_close(logit_lens(other, pairs).logit_diff, lens.logit_diff, atol=1e-5, rtol=0)


def _post_norm_model(tokenizer) -> HeadModel:
    """A tiny OLMo 2 (sub-layer outputs normed before they join the residual, as Gemma 2 / 3) that
    reads the embedded tokenizer's text."""
    from transformers import AutoModelForCausalLM, Olmo2Config

    from tests.support import VOCAB

    torch.manual_seed(0)
    cfg = Olmo2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    return HeadModel(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), tokenizer)


def test_report_on_a_post_norm_family_draws_every_section_that_applies(tmp_path, tokenizer, monkeypatch):
    """The report used to end at DLA's refusal of post-norm families and write nothing (issue 39
    item 12). DLA now decomposes them (frozen post-norm scale, issue 40 item 2), so the page has
    every section; a section that does not apply is left out with its reason, the rest drawn."""
    import viz.reports.patching as report_module

    hm = _post_norm_model(tokenizer)
    out = tmp_path / "p.html"
    _, summary = patching_report(hm, out, load_task_pairs("ioi", n=2), progress=False)
    page = out.read_text(encoding="utf-8")
    assert "patching scores per head" in page and "logit lens" in page
    assert "direct logit attribution by layer" in page and not summary.get("left_out")
    d = tmp_path / "olmo2"
    hm.model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    r = CliRunner().invoke(
        app, ["report", "patching", "--out", str(tmp_path / "c.html"), "--model", str(d), "--n", "2"]
    )
    assert r.exit_code == 0, r.output
    assert "left out" not in r.stdout and (tmp_path / "c.html").is_file()

    def refuse(model):
        raise HeadsteerValueError("norm Odd is not an RMSNorm or a LayerNorm of its input")

    monkeypatch.setattr(report_module, "check_dla_model", refuse)
    out2 = tmp_path / "q.html"
    _, summary = patching_report(hm, out2, load_task_pairs("ioi", n=2), progress=False)
    page = out2.read_text(encoding="utf-8")
    assert "patching scores per head" in page and "logit lens" in page
    assert "sections left out" in page and "direct logit attribution by layer" not in page
    assert "not an RMSNorm" in summary["left_out"]["direct logit attribution"]


def test_cli_refuses_a_pair_that_cannot_show_an_effect_before_the_model_loads(tmp_path):
    f = tmp_path / "pairs.jsonl"
    rows = [
        {"clean": "The cat sat", "corrupted": "The dog sat", "answer": " on", "counterfactual": " in"},
        {"clean": "A b c", "corrupted": "A b c", "answer": " d", "counterfactual": " e"},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = CliRunner().invoke(
        app,
        ["report", "patching", "--out", str(tmp_path / "x.html"), "--model", "/no/model", "--task", str(f)],
    )
    assert r.exit_code == 2 and "pair 1 (clean 'A b c', corrupted 'A b c')" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "x.html").exists()


def test_cli_progress_counts_the_sweeps_token_layers(tiny_llama, tiny_llama_dir, tmp_path, monkeypatch):
    """`headsteer report patching`'s progress moves through the patch sweep in `patch`'s own units
    (token-layers), then one step each for DLA, the lens and the page, each named while it runs;
    it once showed 0/4 until the whole sweep ended, then "patching" during DLA and the lens."""
    import viz.cli.common as cc
    from heads import SweepOptions
    from heads.scorers.patching.activation import patch

    seen: list[tuple[int, int]] = []
    batch = encode_pairs(tiny_llama, load_task_pairs("ioi", n=2))
    patch(tiny_llama, batch, options=SweepOptions(progress=lambda d, t: seen.append((d, t))))
    sweep = seen[-1][1]
    assert sweep > 1
    monkeypatch.setattr(cc, "PLAIN_PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(type(cc.err), "is_terminal", property(lambda self: False))
    r = CliRunner().invoke(
        app, ["report", "patching", "--out", str(tmp_path / "p.html"), "--model", tiny_llama_dir, "--n", "2"]
    )
    assert r.exit_code == 0, r.output
    found = re.findall(r"^(patching head_out|direct logit attribution|logit lens|writing the report): "
                       r"(\d+)/(\d+)", r.stderr, flags=re.M)  # fmt: skip
    steps = [(d, t) for _, d, t in found]
    done = [int(d) for d, _ in steps]
    assert int(steps[-1][1]) == sweep + 3 and done[-1] == sweep + 3
    assert len({d for d in done if 0 < d < sweep + 3}) >= 2  # steps between the start and the end
    assert done == sorted(done)
    # the label names the stage running: the sweep, then DLA, the lens and the page (not "patching")
    labels = [name for name, _, _ in found]
    assert labels[0] == "patching head_out" and labels[-1] == "writing the report"
    assert "direct logit attribution" in labels and "logit lens" in labels
