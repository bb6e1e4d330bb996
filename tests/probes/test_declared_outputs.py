"""`headsteer build refusal-model` declares every file it writes (the tokenizer's
chat_template.jinja too) and checks them all before the fine-tune."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from probes.studies.refusal_model import REFUSAL_MODEL_FILES, planned_files
from viz.cli.main import app


def test_planned_files_include_every_tokenizer_file(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    names = planned_files(tokenizer)
    assert {p.name for p in tmp_path.iterdir()} <= set(names)
    assert "chat_template.jinja" in names and set(REFUSAL_MODEL_FILES) <= set(names)


def test_an_existing_chat_template_fails_before_the_fine_tune(tiny_llama_dir, tmp_path, monkeypatch):
    import probes.studies.refusal_model as rm

    out = tmp_path / "tuned"
    out.mkdir()
    (out / "chat_template.jinja").write_text("{{ mine }}")
    monkeypatch.setattr(rm, "load_requests", lambda *a: pytest.fail("training data read before the check"))
    r = CliRunner().invoke(app, ["build", "refusal-model", "--model", tiny_llama_dir, "--out", str(out)])
    assert r.exit_code == 2 and "chat_template.jinja exists; pass --force" in r.output, r.output
    assert (out / "chat_template.jinja").read_text() == "{{ mine }}"
