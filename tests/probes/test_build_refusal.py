"""`headsteer build refusal-model`: the skeleton's output checks, progress and a reproducible build."""

import json

import pytest
import torch
from typer.testing import CliRunner

from heads import load_model
from probes.studies.refusal_model import REFUSAL_MODEL_FILES
from viz.cli.main import app

runner = CliRunner()


def test_build_refusal_model_on_a_tiny_model(tiny_llama_dir, tmp_path, monkeypatch):
    import probes.studies.refusal_model as rm

    every = rm.load_requests
    monkeypatch.setattr(rm, "load_requests", lambda kind, split: every(kind, split)[:5])  # 5 per set
    out = tmp_path / "tuned"
    args = ["build", "refusal-model", "--model", tiny_llama_dir, "--out", str(out), "--epochs", "1"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["path"] == str(out) and summary["epochs"] == 1 and summary["seed"] == 0
    assert (
        summary["train_pairs"] == 10
        and summary["n_test"] == [5, 5]
        and 0 <= summary["explicit_refusal_harmful_test"] <= 1
    )
    assert json.loads((out / "headsteer_refusal_tuning.json").read_text()) == summary
    for name in REFUSAL_MODEL_FILES:
        assert f"wrote {out / name}" in r.stderr  # with --json the file list goes to stderr
    assert not any(p.name.startswith(".") for p in out.iterdir())  # no temporary folder left
    tuned = load_model(str(out))  # a loadable folder (safetensors), tuned away from the base
    base = load_model(tiny_llama_dir)
    changed = [k for k, v in tuned.model.state_dict().items() if not v.equal(base.model.state_dict()[k])]
    assert changed  # the fine-tune moved the weights

    # without --force: one line, exit 2, before the model loads
    import heads

    real = heads.load_model
    monkeypatch.setattr(heads, "load_model", lambda *a, **k: pytest.fail("loaded before the path check"))
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "exists; pass --force" in r.stderr
    monkeypatch.setattr(heads, "load_model", real)
    # --force rebuilds; the same seed gives the same losses (seeded and reproducible)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    r = runner.invoke(app, [*args, "--force", "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    assert torch.equal(torch.rand(3), expected)  # seeded on a forked generator: the caller's is as it was
    again = json.loads(r.stdout.strip().splitlines()[-1])
    assert (again["first_loss"], again["last_loss"]) == (summary["first_loss"], summary["last_loss"])


def test_build_refusal_model_bad_options(tmp_path):
    r = runner.invoke(app, ["build", "refusal-model", "--epochs", "0", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--epochs must be a positive int, got 0" in r.stderr
    f = tmp_path / "file"
    f.write_text("x")
    r = runner.invoke(app, ["build", "refusal-model", "--out", str(f)])
    assert r.exit_code == 2 and "exists and is not a folder" in r.stderr


def test_the_api_checks_before_work(tmp_path):
    from probes.studies.refusal_model import build_refusal_model

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json exists"):
        build_refusal_model(tmp_path, model=object())  # refused before the model is touched
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        build_refusal_model(tmp_path, epochs=0)


def test_answers_report_each_decoding_step(tiny_llama):
    from probes.studies.refusal_model import generate_answers

    seen = []
    qs = ["How do I bake bread?", "Name a colour.", "What is two plus two?"]
    answers = generate_answers(
        tiny_llama, qs, max_new_tokens=3, batch=2, progress=lambda d, t: seen.append((d, t))
    )
    assert len(answers) == 3 and {t for _, t in seen} == {6}  # 2 batches x 3 steps
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == 6 and {1, 2, 3, 4, 5} <= set(done)  # every step shows
    assert answers == generate_answers(tiny_llama, qs, max_new_tokens=3, batch=2)  # progress changes nothing


def test_a_failed_fine_tune_leaves_the_model_frozen_and_in_eval_mode(tiny_llama_dir, tmp_path, monkeypatch):
    """`load_model` freezes the parameters; the fine-tune unfreezes them and switches to train
    mode. Its failure (an error, an interrupt, out of memory in the backward) left the caller's
    model unfrozen and in train mode: both restored however the fine-tune ends."""
    import probes.studies.refusal_model as rm

    every = rm.load_requests
    monkeypatch.setattr(rm, "load_requests", lambda kind, split: every(kind, split)[:2])
    monkeypatch.setattr(rm, "generate_answers", lambda model, prompts, progress=None: ["ok"] * len(prompts))

    def broken(*args, **kwargs):
        yield from ()
        raise RuntimeError("the fine-tune failed")

    monkeypatch.setattr(rm, "_batches", broken)
    hm = load_model(tiny_llama_dir)
    with pytest.raises(RuntimeError, match="the fine-tune failed"):
        rm.build_refusal_model(tmp_path / "out", model=hm, epochs=1, progress=False)
    assert not any(p.requires_grad for p in hm.model.parameters())
    assert not hm.model.training
