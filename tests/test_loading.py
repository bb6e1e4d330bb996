"""Loading: cache folder rules, local HF folders, low-precision models."""

import pytest
import torch
from conftest import make_tiny

from heads import HeadModel, Recorder, cache_dir, editing, encode_prompts, forward, load_model
from steer import Pasta


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HEADSTEER_CACHE", str(tmp_path / "hs"))
    assert cache_dir() == tmp_path / "hs"
    monkeypatch.delenv("HEADSTEER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "headsteer"


def test_load_local_folder(tmp_path, tiny_llama, tokenizer):
    tiny_llama.model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    hm = load_model(tmp_path)
    assert isinstance(hm, HeadModel) and hm.name == str(tmp_path)
    assert (hm.n_layers, hm.n_heads, hm.n_kv_heads) == (3, 4, 2)
    enc = encode_prompts(tokenizer, "same weights, same logits", chat=False)
    assert torch.equal(forward(hm, enc), forward(tiny_llama, enc))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder"):
        load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_pasta_has_no_nan(tokenizer, dtype):
    hm = make_tiny("llama", tokenizer)
    hm.model.to(dtype)
    enc = encode_prompts(
        tokenizer, ["A **b** c d e", "Longer prompt with **a span** and more words"], chat=False
    )
    rec = Recorder(layer=1)
    with editing(hm, Pasta({"0": [0, 1], "1": [2, 3]}, alpha=1e-4).edits(hm, enc) + [rec]):
        out = forward(hm, enc)
    assert torch.isfinite(out).all()
    real = enc.attention_mask.bool()
    sums = rec.records[0].sum(-1).permute(0, 2, 1)[real]
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-3, rtol=0)
    with editing(hm, Pasta({"0": [0, 1], "1": [2, 3]}, alpha=1e-4).edits(hm, enc)):
        assert torch.isfinite(forward(hm, enc)).all()
