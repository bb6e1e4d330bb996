"""The model organism: the cut tokenizer, seeded data, bitwise-deterministic training, the
attention-only Llama that `load_model` accepts, and `build_organism`'s folder rules."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from heads import HeadsteerValueError, load_model
from heads.model.loading import no_empty_init_warning
from probes.datasets.corpus import load_corpus
from probes.organism.build import MANIFEST, build_organism, organism_outputs
from probes.organism.data import CorpusStream, batch_rows, icl_rows
from probes.organism.recipe import OrganismSpec
from probes.organism.tokenizer import truncated_tokenizer
from tests.support.oracle import llama_forward
from tests.support.organism import TINY_SPEC, tiny_run


@pytest.fixture(scope="module")
def cut(tokenizer):
    return truncated_tokenizer(512, base=tokenizer)


def test_cut_tokenizer_keeps_the_first_ids_and_encodes_every_text(cut, tokenizer):
    assert len(cut) == 512 and cut.bos_token == "<|im_start|>" and cut.pad_token_id == 2
    for text in load_corpus()[:40]:
        ids = cut(text, add_special_tokens=False)["input_ids"]
        assert max(ids) < 512 and cut.decode(ids) == text
        # a token the full tokenizer produces with an id below the cut is a token of the cut too
        full = tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
        kept = {t for t, i in zip(full, tokenizer.convert_tokens_to_ids(full), strict=True) if i < 512}
        assert kept <= set(cut.get_vocab())
    with pytest.raises(HeadsteerValueError, match="vocab_size"):
        truncated_tokenizer(10, base=tokenizer)


def test_batches_depend_only_on_seed_and_step(cut):
    corpus = CorpusStream(cut)
    kw = dict(batch=6, context=24, tokenizer=cut, corpus=corpus, repeat_fraction=0.5)
    (a, kinds), (b, _) = batch_rows(3, seed=1, **kw), batch_rows(3, seed=1, **kw)
    assert torch.equal(a, b) and not torch.equal(a, batch_rows(4, seed=1, **kw)[0])
    assert not torch.equal(a, batch_rows(3, seed=2, **kw)[0])
    assert (a[:, 0] == cut.bos_token_id).all() and a.shape == (6, 24) and kinds.shape == (6,)
    text = corpus.ids.tolist()
    for row, rep_row in zip(a[:, 1:].tolist(), kinds.tolist(), strict=True):
        if not rep_row:  # a corpus row is a window of the corpus stream
            assert any(text[i : i + 23] == row for i in range(len(text) - 22))
    rep, kinds = batch_rows(0, seed=0, **{**kw, "repeat_fraction": 1.0})
    assert kinds.all()
    for row in rep[:, 1:]:  # each row is a segment repeated: some period n <= 11 fits the row
        assert any(torch.equal(row[n:], row[:-n]) for n in range(4, 12))
    icl = icl_rows(cut, n=3, context=21)
    assert icl.shape == (3, 21) and torch.equal(icl[:, 1:11], icl[:, 11:])


def test_same_seed_gives_bitwise_the_same_checkpoints(tmp_path):
    a = tiny_run(tmp_path / "a", steps=3, checkpoint_every=3)
    b = tiny_run(tmp_path / "b", steps=3, checkpoint_every=3)
    c = tiny_run(tmp_path / "c", steps=3, checkpoint_every=3, seed=1)
    names = sorted(p.name for p in a.glob("step-*"))
    assert names == ["step-000000", "step-000001", "step-000002", "step-000003"]
    for n in names:
        assert (a / n / "model.safetensors").read_bytes() == (b / n / "model.safetensors").read_bytes()
    assert (a / names[-1] / "model.safetensors").read_bytes() != (
        c / names[-1] / "model.safetensors"
    ).read_bytes()
    log = json.loads((a / "training_log.json").read_text())
    assert len(log["losses"]) == 3 and log["checkpoints"] == [0, 1, 2, 3]


def test_attention_only_checkpoint_loads_and_computes_what_the_oracle_computes(tmp_path):
    run = tiny_run(tmp_path / "run", steps=2)
    hm = load_model(run / "step-000002")
    assert hm.model.config.intermediate_size == 0 and hm.family.attention_only
    ids = torch.tensor([[1, 40, 41, 42, 40, 41]])
    want = llama_forward(hm.model, ids, torch.ones_like(ids))
    with torch.no_grad():
        got = hm.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the MLP adds exactly nothing
    x = torch.randn(1, 3, TINY_SPEC.d_model)
    assert hm.mlp(0)(x).abs().max().item() == 0.0


def test_intermediate_size_zero_is_refused_outside_attention_only_families(tmp_path, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=16,
        intermediate_size=0,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    with no_empty_init_warning():
        Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "q")
    with pytest.raises(HeadsteerValueError, match="intermediate_size must be a positive int"):
        load_model(tmp_path / "q")


def test_spec_checks_values_before_training():
    with pytest.raises(HeadsteerValueError, match="n_heads 3 must divide"):
        OrganismSpec(n_heads=3)
    with pytest.raises(HeadsteerValueError, match="name"):
        OrganismSpec(name="a/b")
    assert OrganismSpec.from_dict(TINY_SPEC.to_dict()) == TINY_SPEC
    assert TINY_SPEC.checkpoint_steps() == [0, 1, 2, 4]


def test_build_is_atomic_and_needs_force_to_replace(tmp_path):
    spec = TINY_SPEC.__class__(**{**TINY_SPEC.to_dict(), "steps": 1})
    out = tmp_path / "org"
    seen = []
    manifest = build_organism(out, specs=[spec], progress=lambda d, t: seen.append((d, t)))
    assert (out / MANIFEST).is_file() and (out / "tiny" / "step-000001" / "config.json").is_file()
    assert seen[-1] == (1, 1) and manifest["runs"]["tiny"]["checkpoints"] == [0, 1]
    with pytest.raises(HeadsteerValueError, match="--force"):
        build_organism(out, specs=[spec], progress=False)
    build_organism(out, specs=[spec], overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["org"]  # no temporary folder left
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(HeadsteerValueError, match="other files"):
        build_organism(other, specs=[spec], overwrite=True, progress=False)
    assert (other / "notes.txt").read_text() == "keep"

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_organism(tmp_path / "new", specs=[spec], progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "org"]


def test_force_replaces_only_the_builds_own_outputs(tmp_path):
    spec = TINY_SPEC.__class__(**{**TINY_SPEC.to_dict(), "steps": 2})
    out = tmp_path / "org"
    build_organism(out, specs=[spec], progress=False)
    (out / "NOTES.txt").write_text("mine")
    (out / "tiny" / "NOTES.txt").write_text("mine too")
    manifest = build_organism(out, specs=[replace(spec, steps=1, seed=9)], overwrite=True, progress=False)
    assert (out / "NOTES.txt").read_text() == "mine"
    assert (out / "tiny" / "NOTES.txt").read_text() == "mine too"
    assert not (out / "tiny" / "step-000002").exists()  # the previous build's checkpoint, not rebuilt
    assert sorted(p.name for p in (out / "tiny").iterdir()) == [
        "NOTES.txt",
        "step-000000",
        "step-000001",
        "training_log.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["org"]  # no temporary folder left
    assert organism_outputs(out, manifest) == [
        out / "tiny" / "step-000000",
        out / "tiny" / "step-000001",
        out / "tiny" / "training_log.json",
        out / MANIFEST,
    ]
    assert json.loads((out / MANIFEST).read_text())["specs"][0]["seed"] == 9
    meta = json.loads((out / "tiny" / "step-000001" / "headsteer_checkpoint.json").read_text())
    assert meta["spec"]["seed"] == 9  # the new training's checkpoint


def test_a_build_of_one_run_keeps_the_others_listed_and_never_mixes_trainings(tmp_path):
    """`--only b --force` over a build of a and b: a's folder stays and `organism.json` still
    lists it (it listed b only, so a later `--only a --force` with fewer steps did not know a's
    old checkpoints and left step-000002 and step-000004 of the first training beside the new
    ones: one run folder mixing two trainings)."""
    a, b = replace(TINY_SPEC, name="a", steps=4), replace(TINY_SPEC, name="b", steps=2)
    out = tmp_path / "org"
    build_organism(out, specs=[a, b], progress=False)
    (out / "a" / "NOTES.txt").write_text("mine")
    before = {p.name: p.stat().st_mtime_ns for p in (out / "a").iterdir()}
    manifest = build_organism(out, specs=[replace(b, seed=3)], overwrite=True, progress=False)
    on_disk = json.loads((out / MANIFEST).read_text())
    assert [s["name"] for s in on_disk["specs"]] == ["a", "b"] and on_disk["specs"][1]["seed"] == 3
    assert manifest["trained"] == ["b"] and list(manifest["runs"]) == ["a", "b"]
    assert on_disk["runs"]["a"]["checkpoints"] == [0, 1, 2, 4]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "a").iterdir()} == before  # a untouched
    assert organism_outputs(out, manifest) == [
        out / "b" / "step-000000",
        out / "b" / "step-000001",
        out / "b" / "step-000002",
        out / "b" / "training_log.json",
        out / MANIFEST,
    ]  # only what this build wrote
    manifest = build_organism(out, specs=[replace(a, steps=1, seed=5)], overwrite=True, progress=False)
    assert sorted(p.name for p in (out / "a").iterdir()) == [
        "NOTES.txt",
        "step-000000",
        "step-000001",
        "training_log.json",
    ]
    for step in ("step-000000", "step-000001"):
        assert json.loads((out / "a" / step / "headsteer_checkpoint.json").read_text())["spec"]["seed"] == 5
    assert list(manifest["runs"]) == ["a", "b"] and manifest["runs"]["a"]["checkpoints"] == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["org"]  # no temporary folder left


def test_build_without_progress_prints_no_transformers_bar(tmp_path, capfd):
    """progress=False prints nothing: transformers' "Writing model shards" bar of every checkpoint
    was shown from the API (the CLI turned it off process-wide); its switch is restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        build_organism(tmp_path / "org", specs=[replace(TINY_SPEC, steps=1)], progress=False)
        err = capfd.readouterr().err
        assert "Writing model shards" not in err and "%|" not in err
        assert hf_logging.is_progress_bar_enabled()  # restored
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
