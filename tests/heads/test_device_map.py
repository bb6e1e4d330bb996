"""Models placed by accelerate (`load_model(device_map=...)`): edits work with layers offloaded
to disk and (where two devices exist) on different devices, with the same logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from heads import HeadScale, QueryScale, Recorder, editing, encode_prompts, load_model  # noqa: E402
from heads.engine.executors import ModelSpec  # noqa: E402
from steer import Act, Pasta, Spotlight, SteeredModel  # noqa: E402

PROMPT = "Read this: the key is **blue** and the door is red. What is the key?"


def _split_map(late: str) -> dict:
    """Embeddings and layer 0 on CPU; layers 1-2, the final norm and the head on `late`."""
    return {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": late,
        "model.layers.2": late,
        "model.norm": late,
        "lm_head": late,
    }


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def offloaded(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload")
    hm = load_model(tiny_llama_dir, device_map=_split_map("disk"), offload_folder=folder)
    assert any(
        p.device.type == "meta" for p in hm.model.parameters()
    )  # weights offloaded (read from disk at use)
    return hm


def _logits(hm, edits_for) -> torch.Tensor:
    enc = encode_prompts(hm.tokenizer, [PROMPT, "Say **hello** to the world, please"])
    with torch.no_grad(), editing(hm, edits_for(hm, enc)):
        out = hm.model(
            input_ids=enc.input_ids.to(hm.device), attention_mask=enc.attention_mask.to(hm.device)
        ).logits
    return out.float().cpu()


EDITS = {
    "pasta": lambda hm, enc: Pasta({"1": [0, 2], "2": [1]}, alpha=0.01).edits(hm, enc),
    "spotlight": lambda hm, enc: Spotlight(tau=0.3, layers=(1, 2)).edits(hm, enc),
    "act": lambda hm, enc: Act({"2": [0, 3]}, beta=0.4).edits(hm, enc),
    "head_output": lambda hm, enc: [HeadScale(layer=2, heads=[1], factor=0.0)],
    "query": lambda hm, enc: [QueryScale(layer=1, heads=[3], factor=0.0)],
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_edits_with_disk_offload_equal_plain_model(plain, offloaded, name):
    steered = _logits(plain, EDITS[name])
    assert not torch.equal(steered, _logits(plain, lambda hm, enc: []))  # the edit changes the logits
    assert torch.allclose(_logits(offloaded, EDITS[name]), steered, rtol=0, atol=1e-5)


def test_recorder_and_generation_with_disk_offload(plain, offloaded):
    def rec(hm, enc):
        return [Recorder(layer=2, heads=[0])]

    with torch.no_grad():
        enc = encode_prompts(plain.tokenizer, PROMPT)
        got = []
        for hm in (plain, offloaded):
            with editing(hm, rec(hm, enc)) as (r,):
                hm.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
            got.append(r.records[0])
    assert torch.allclose(got[0], got[1], atol=1e-6)
    steer = [Pasta({"1": [0, 2]}, alpha=0.01)]
    a = SteeredModel(plain).generate(PROMPT, steer=steer, max_new_tokens=6)
    b = SteeredModel(offloaded).generate(PROMPT, steer=steer, max_new_tokens=6)
    assert a.token_ids == b.token_ids
    # and the model is restored after the context
    assert torch.equal(_logits(offloaded, lambda hm, enc: []), _logits(plain, lambda hm, enc: []))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device besides the CPU")
def test_edits_across_cpu_and_gpu(plain, tiny_llama_dir):
    split = load_model(tiny_llama_dir, device_map=_split_map("cuda:0"))
    for name, fn in EDITS.items():
        assert torch.allclose(_logits(split, fn), _logits(plain, fn), rtol=0, atol=1e-4), name


def test_auto_device_map_on_this_machine(plain, tiny_llama_dir):
    auto = load_model(tiny_llama_dir, device_map="auto")
    fn = EDITS["pasta"]
    assert torch.allclose(_logits(auto, fn), _logits(plain, fn), rtol=0, atol=1e-5)
    assert ModelSpec.of(auto).name_or_path is not None


def test_unknown_device_map_module_is_refused_before_loading(tiny_llama_dir, monkeypatch):
    import transformers

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    bad = {**_split_map("cpu"), "model.layer.7": "cpu"}
    with pytest.raises(ValueError, match=r"device_map names 'model\.layer\.7', which is no module"):
        load_model(tiny_llama_dir, device_map=bad)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(device_map={}), ValueError, r"device_map \{\} is empty"),
        (dict(device_map=["cpu"]), TypeError, r"got \['cpu'\] \(list\)"),
        (dict(device_map=0), TypeError, r"got 0 \(int\)"),
        (dict(device_map="bogus"), ValueError, r"device_map 'bogus' is not a strategy"),
        (dict(device_map=_split_map("meta")), ValueError, r"device_map\['model\.layers\.1'\] = 'meta'"),
        (dict(device_map=_split_map("tpu")), ValueError, r"'tpu' is not a torch device \(cpu, cuda:N"),
        (
            dict(device_map=_split_map(f"cuda:{torch.cuda.device_count()}")),
            ValueError,
            f"'cuda:{torch.cuda.device_count()}': no such GPU here",
        ),
        (
            dict(device_map=_split_map("disk")),
            ValueError,
            r"puts 'model\.layers\.1' on 'disk': pass offload_folder",
        ),
        (dict(device_map="auto", device="cpu"), ValueError, r"device='cpu' and device_map='auto' both given"),
        (dict(device="meta"), ValueError, r"device='meta': the meta device holds no weights"),
        (dict(device=f"cuda:{torch.cuda.device_count()}"), ValueError, "no such GPU here"),
        (dict(device="disk"), ValueError, r"device='disk' is not a torch device \(cpu, cuda, cuda:N, mps\)"),
    ],
)
def test_bad_device_maps_are_refused_before_loading(tiny_llama_dir, monkeypatch, kwargs, error, match):
    """Each malformed placement is one clear error naming the value, before any weight is read."""
    import transformers

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    with pytest.raises(error, match=match):
        load_model(tiny_llama_dir, **kwargs)
