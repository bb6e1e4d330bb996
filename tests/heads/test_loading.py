"""Loading: cache folder rules, local HF folders, low-precision models."""

import pytest
import torch

from heads import HeadModel, Recorder, cache_dir, editing, encode_prompts, forward, load_model
from steer import Pasta
from tests.support import make_tiny


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


@pytest.mark.parametrize(
    "dtype", ["float8", "", "Float32", "float8_e4m3fn", torch.float8_e4m3fn, torch.int8, 32]
)
def test_bad_dtype_is_refused_before_loading(tmp_path, dtype):
    """A dtype outside heads.model.loading.DTYPES: ValueError naming it and the allowed names, checked
    before the folder is even looked at (the folder does not exist)."""
    with pytest.raises(ValueError, match=r"dtype must be one of float32, bfloat16, float16, got "):
        load_model(tmp_path / "missing", dtype=dtype)


def test_dtype_by_name_matches_the_cli_list(tiny_llama_dir):
    from heads.model.loading import DTYPES, check_dtype
    from viz.cli.common import check_dtype as cli_check_dtype

    assert [check_dtype(n) for n in DTYPES] == [cli_check_dtype(n) for n in DTYPES]
    assert [check_dtype(n) for n in DTYPES] == [torch.float32, torch.bfloat16, torch.float16]
    hm = load_model(tiny_llama_dir, dtype="bfloat16")
    assert {p.dtype for la in hm.layers for p in la.parameters()} == {torch.bfloat16}


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


def _saved(tmp_path, tiny_llama, tokenizer, name="m"):
    d = tmp_path / name
    tiny_llama.model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "model.safetensors").write_bytes(b"not a safetensors file" * 4), "header"),
        (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
            "header",
        ),
        (lambda d: (d / "config.json").write_text("{garbage"), "config"),
        (lambda d: (d / "tokenizer.json").write_text("{garbage"), "property name"),
    ],
    ids=["garbage", "truncated", "config", "tokenizer"],
)
def test_damaged_model_folder_is_one_value_error(tmp_path, tiny_llama, tokenizer, damage, match):
    d = _saved(tmp_path, tiny_llama, tokenizer)
    damage(d)
    with pytest.raises(ValueError, match=f"cannot read the model in .*m'.*{match}"):
        load_model(d)


def test_pickled_weights_are_refused_unread(tmp_path, tiny_llama, tokenizer, monkeypatch):
    d = _saved(tmp_path, tiny_llama, tokenizer)
    torch.save(tiny_llama.model.state_dict(), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()

    def never(*a, **k):
        raise AssertionError("a pickle was loaded")

    monkeypatch.setattr(torch, "load", never)
    with pytest.raises(ValueError, match="only pickled weights \\(pytorch_model.bin\\).*never loads pickles"):
        load_model(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="no model weights"):
        load_model(d)


def test_cache_build_cleans_dead_builds_and_is_group_readable(tmp_path):
    import os
    import stat
    import time

    from heads.model.loading import _write_cache, clean_stale_cache

    cache = tmp_path / "cache"
    dead = cache / ".tmp-dead"
    dead.mkdir(parents=True)
    (dead / "model.safetensors").write_bytes(b"half")

    def save(tmp):
        (tmp / "model.safetensors").write_bytes(b"weights")
        (tmp / "config.json").write_text("{}")

    old = os.umask(0o077)  # the strictest umask: the cache must still be group-readable
    try:
        _write_cache(cache / "model", save)
    finally:
        os.umask(old)
    assert not dead.exists() and [p.name for p in cache.glob(".tmp-*")] == []
    target = cache / "model"
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert stat.S_IMODE(target.stat().st_mode) & 0o050 == 0o050
    assert stat.S_IMODE((target / "config.json").stat().st_mode) & 0o040 == 0o040
    # a second build finds the cache built and does not call save
    _write_cache(target, lambda tmp: (_ for _ in ()).throw(AssertionError("rebuilt")))
    # leftovers from a killed build are removed on the next load when nobody builds ...
    (cache / ".tmp-killed").mkdir()
    assert [p.name for p in clean_stale_cache(cache)] == [".tmp-killed"]
    # ... and, while a build holds the lock, only those older than an hour
    from heads.model.loading import _cache_lock

    fresh, stale = cache / ".tmp-fresh", cache / ".tmp-stale"
    fresh.mkdir(), stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()

    def hold():
        with _cache_lock(cache):
            ready.set()
            done.wait(30)

    p = ctx.Process(target=hold)
    p.start()
    try:
        assert ready.wait(30)
        assert [x.name for x in clean_stale_cache(cache)] == [".tmp-stale"]
        assert fresh.exists()
    finally:
        done.set()
        p.join(30)


def test_loaded_parameters_are_frozen_so_a_layer_keeps_no_weight_inputs(tmp_path, tiny_llama, tokenizer):
    """`load_model` freezes the parameters: a gradient through a layer (the analyses' layer walk)
    then keeps fewer saved tensors (no linear layer's input for a weight gradient) and gives the
    same input gradient."""
    from heads.scorers.layerwise import record_inputs, run_layer

    tiny_llama.model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    hm = load_model(tmp_path)
    assert not any(p.requires_grad for p in hm.model.parameters())
    enc = encode_prompts(tokenizer, "a prompt for one layer's gradient", chat=False)
    ids, mask = enc.input_ids, enc.attention_mask
    _, rec = record_inputs(hm, ids, mask, [1])

    def saved_and_grad() -> tuple[int, torch.Tensor]:
        nbytes = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            nbytes[0] += t.numel() * t.element_size()
            return t

        x = rec[1].clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_layer(hm, ids, mask, 1, x)
        (g,) = torch.autograd.grad(out.square().sum(), [x])
        return nbytes[0], g

    frozen, g_frozen = saved_and_grad()
    hm.model.requires_grad_(True)
    trainable, g_trainable = saved_and_grad()
    assert frozen < trainable
    torch.testing.assert_close(g_frozen, g_trainable, rtol=0, atol=0)
