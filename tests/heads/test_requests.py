"""Every analysis request (`heads.scorers.request_base.Request`): JSON in and out, an unknown key and
a bad value refused by name, and the geometry checked against a big model's published config
before any weight exists (Llama-3.1-8B's numbers, written here; no download, no weights)."""

from __future__ import annotations

import pytest

from heads.engine.options import SweepOptions
from heads.errors import HeadsteerError, HeadsteerValueError
from heads.scorers.dispatch import RUNNERS, run
from heads.scorers.request_base import Geometry, Request, request_classes

# meta-llama/Llama-3.1-8B config.json (the fields that set its geometry)
LLAMA_31_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
}

# name -> (a valid non-default request's fields, (field, bad value, message), fields out of range
# for Llama-3.1-8B or None where the request holds no geometry)
CASES: dict[str, tuple[dict, tuple, dict | None]] = {
    "patch": (
        {"kind": "resid_pre", "layers": [3, 1], "positions": [-1, 2], "direction": "noising"},
        ("kind", "bogus", "unknown patching kind 'bogus'"),
        {"layers": [32]},
    ),
    "path_patch": (
        {"senders": [[0, 1]], "receivers": [[5, 2]], "inputs": ["k", "v"], "mlp": "frozen"},
        ("mlp", "thawed", "mlp must be one of"),
        {"senders": [[31, 32]]},
    ),
    "direct_logit_attribution": (
        {"which": "corrupted", "stability": 10},
        ("which", "dirty", "which must be"),
        None,
    ),
    "logit_lens": ({"k": 3}, ("k", 0, "k must be a positive int"), None),
    "knockout": (
        {"keys": {"IO": "IO", "S": ["S1", "S2"]}, "layers": [4, 5], "heads": [1], "per": "head"},
        ("factor", -1, "factor must be"),
        {"layers": [40]},
    ),
    "find_circuit": ({"method": "eap", "size": 2.0, "curve": False}, ("steps", 0, "steps must be"), None),
    "detect_roles": ({"retrieval": False, "seed": 3}, ("successor", "yes", "successor must be"), None),
    "train_lens": (
        {"heads": {"3": [1, 2]}, "epochs": 2, "lr": 0.01},
        ("held_out", 1.0, "held_out must be"),
        {"heads": [[32, 0]]},
    ),
    "head_atlas": (
        {"thresholds": {"induction": 0.4}, "thumbnails": False},
        ("thresholds", {"layer": 1}, "role 'layer'"),
        None,
    ),
    "ships": (
        {"heads": [[0, 0], [1, 3]], "ablation": "sc", "method": "attribution", "confirm": 2},
        ("ablation", "zero", "ablation must be one of"),
        {"heads": [[0, 32]]},
    ),
    "dataset_ships": (
        {"r_main": 2, "degrees": True},
        ("template", "no placeholder", "template must be"),
        {"heads": [[33, 0]]},
    ),
    "sahara": ({"steps": 2, "exact": True}, ("eps", 2.0, "eps must be"), {"heads": [[32, 1]], "steps": 1}),
    "attribution_patching": (
        {"ablation": "mean", "graddrop": True, "kl_tokens": 8},
        ("metric", "l2", "metric must be 'kl'"),
        {"heads": [[0, 99]]},
    ),
    "maps_scores": ({"apply_first_mlp": False}, ("apply_first_mlp", 1, "apply_first_mlp must be"), None),
    "qrhead_scores": ({"null_query": "none", "chat": False}, ("null_query", " ", "null_query must be"), None),
    "gate_heads": (
        {"steps": 20, "n_masks": 3, "stability": 10, "init": [0.2, 0.8]},
        ("init", [0.9, 0.1], "init must have low <= high"),
        {"heads": [[32, 0]]},
    ),
    "sink_stats": ({"rule": "absolute", "theta": 0.2}, ("exempt", "none", "exempt must be one of"), None),
    "find_sink_dims": (
        {"from_layer": 1, "max_dims": 2},
        ("min_ratio", 1, "min_ratio must be"),
        {"from_layer": 32},
    ),
    "qk_attribution": (
        {"head": "5.1", "query": [-1, -2], "by": "source_token"},
        ("by", "token", "by must be one of"),
        {"head": [32, 0]},
    ),
    "composition_scores": (
        {"readers": [[2, 1]], "n_samples": 7},
        ("n_samples", 0, "n_samples must be"),
        {"readers": [[1, 40]]},
    ),
}


def test_every_request_has_a_case_and_a_runner():
    assert sorted(CASES) == sorted(request_classes())
    assert set(RUNNERS) == set(request_classes().values())


@pytest.mark.parametrize("name", sorted(CASES))
def test_request_json_round_trip_and_refusals(name):
    cls = request_classes()[name]
    good, (field, bad, message), _ = CASES[name]
    req = cls(**good)
    text = req.to_json()
    assert cls.from_json(text) == req
    assert Request.from_json(text) == req  # the base picks the class by its "request" name
    assert Request.from_json(req.to_dict()) == req
    with pytest.raises(HeadsteerValueError, match="unknown key 'bogus_key'"):
        cls.from_json({**req.to_dict(), "bogus_key": 1})
    with pytest.raises(HeadsteerError, match=message):
        cls(**{**good, field: bad})
    with pytest.raises(HeadsteerError, match=message):  # the same check when read from JSON
        cls.from_json({**req.to_dict(), field: bad})
    with pytest.raises(HeadsteerValueError, match="version"):
        cls.from_json({**req.to_dict(), "version": cls.VERSION + 1})
    with pytest.raises(HeadsteerValueError, match="expected a"):
        cls.from_json({**req.to_dict(), "request": "patch" if name != "patch" else "ships"})


@pytest.mark.parametrize("name", sorted(CASES))
def test_geometry_is_checked_on_the_config_before_any_weight(name):
    cls = request_classes()[name]
    good, _, out_of_range = CASES[name]
    req = cls(**good)
    req.check_config(LLAMA_31_8B)  # in range on Llama-3.1-8B
    if out_of_range is None:
        return
    with pytest.raises(
        HeadsteerValueError, match=r"unknown (layer|head|KV head)|from_layer must be|position"
    ):
        cls(**{**good, **out_of_range}).check_config(LLAMA_31_8B)


def test_check_config_reads_the_family():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**LLAMA_31_8B)
    geo = Geometry.of(cfg)
    assert (geo.n_layers, geo.n_heads, geo.n_kv_heads, geo.max_positions) == (32, 32, 8, 131072)
    patch = request_classes()["patch"]
    patch(kind="k").check_config(cfg)
    # a family refused as a whole, and one without a site kind
    with pytest.raises(HeadsteerValueError, match="mamba"):
        patch().check_config({"model_type": "mamba", "num_hidden_layers": 2})
    olmo2 = {**LLAMA_31_8B, "model_type": "olmo2"}
    with pytest.raises(HeadsteerValueError, match="kind='k' is not available on 'olmo2'"):
        patch(kind="k").check_config(olmo2)
    patch(kind="v").check_config(olmo2)
    granite = {**LLAMA_31_8B, "model_type": "granite", "residual_multiplier": 0.22}
    with pytest.raises(
        HeadsteerValueError, match="kind='mlp_out' is not available on 'granite' with a residual"
    ):
        patch(kind="mlp_out").check_config(granite)
    patch(kind="mlp_out").check_config({**granite, "residual_multiplier": 1.0})
    with pytest.raises(HeadsteerValueError, match="position 200000 is beyond the model's 131072 positions"):
        patch(kind="resid_pre", positions=[200000]).check_config(cfg)
    with pytest.raises(HeadsteerValueError, match="does not support model_type 'opt'"):
        request_classes()["qk_attribution"](head="1.1").check_config({**LLAMA_31_8B, "model_type": "opt"})


def test_json_refuses_what_it_cannot_hold_and_bad_text():
    patch = request_classes()["patch"]
    with pytest.raises(HeadsteerValueError, match="metric=.*cannot be written as JSON"):
        patch(metric=lambda logits, pairs, index: logits[:, 0]).to_json()
    with pytest.raises(HeadsteerValueError, match="not valid JSON"):
        Request.from_json("{not json")
    with pytest.raises(HeadsteerValueError, match="unknown request 'nope'"):
        Request.from_json({"request": "nope"})
    with pytest.raises(HeadsteerValueError, match="must be a JSON object"):
        Request.from_json("[1, 2]")


def test_a_plain_word_names_the_requests_accepted(tiny_llama):
    """`run(model, "dla", ...)`: not a JSON syntax error but the request names accepted."""
    for word, cls in (("dla", "DLARequest"), ("patch", "PatchRequest"), ("nope", "DLARequest")):
        with pytest.raises(HeadsteerValueError, match=f"unknown request '{word}'; pass a request") as e:
            run(tiny_llama, word, [])
        assert f"heads.{cls}()" in str(e.value) and all(n in str(e.value) for n in request_classes())
    with pytest.raises(HeadsteerValueError, match="unknown request 'dla'"):
        Request.from_json(b" dla ")


def test_run_dispatches_a_json_request(tiny_llama):
    from heads.scorers.patching import pairs_from_tokens

    pairs = pairs_from_tokens([[40, 41, 42, 43]], [[40, 49, 42, 43]], [[20]], [[21]])
    got = run(tiny_llama, {"request": "direct_logit_attribution"}, pairs)
    from heads.scorers.patching.logit import direct_logit_attribution

    want = direct_logit_attribution(tiny_llama, pairs)
    assert type(got) is type(want) and got.heads.equal(want.heads)
    with pytest.raises(HeadsteerValueError, match="layers: unknown layer 7"):  # before any forward
        run(tiny_llama, {"request": "patch", "layers": [7]}, pairs)
    with pytest.raises(HeadsteerValueError, match="needs its input"):
        run(tiny_llama, {"request": "patch"})


# the patching kinds each tiny family lacks: OPT's MLP is not one module; multi-head latent
# attention (MiniCPM3, DeepSeek-V2) has no per-KV-head k / v, and MiniCPM3 scales its sub-layer
# outputs (scale_depth / sqrt(n_layers)); OLMo 2's key norm spans every head
REFUSED_KINDS = {
    "opt": {"mlp_out"},
    "minicpm3": {"mlp_out", "k", "v"},
    "deepseek_v2": {"k", "v"},
    "olmo2": {"k"},
}


@pytest.mark.parametrize("family", ["llama", "opt", "granite", "minicpm3", "deepseek_v2", "olmo2", "gpt2"])
def test_patch_request_refuses_the_kinds_a_family_lacks(family, tokenizer):
    """The request's kind check refuses exactly the kinds the family lacks, from the config
    alone and from the loaded model alike, and `patch` refuses them before any forward."""
    from heads.scorers.patching import pairs_from_tokens
    from heads.scorers.patching.activation import patch as run_patch
    from tests.support.families import _tiny_config, shared_family_model

    patch = request_classes()["patch"]
    hm, config = shared_family_model(family), _tiny_config(family)
    pairs = pairs_from_tokens([[5, 6, 7, 8]], [[5, 9, 7, 8]], [[10]], [[11]])
    for kind in ("resid_pre", "attn_out", "mlp_out", "head_out", "q", "k", "v", "pattern"):
        if kind in REFUSED_KINDS.get(family, ()):
            with pytest.raises(HeadsteerValueError, match=f"kind='{kind}' is not available") as a:
                patch(kind=kind).check_config(config)
            with pytest.raises(HeadsteerValueError) as b:
                patch(kind=kind).check_config(hm)
            with pytest.raises(HeadsteerValueError) as c:
                run_patch(hm, pairs, kind, options=SweepOptions(progress=lambda d, t: pytest.fail("ran")))
            assert str(a.value) == str(b.value) == str(c.value)
        else:
            patch(kind=kind).check_config(config)
            patch(kind=kind).check_config(hm)


def test_from_json_is_strict_and_opens_no_file(tmp_path, monkeypatch):
    """A request from JSON: `version` an int, a key given twice refused (named), and a head
    selection given as a string (a file path on the machine that runs it) refused, naming the
    field; a Python caller may still name a head file, and a missing one is a HeadsteerValueError."""
    import json

    from heads.scorers.safety.request import ShipsRequest

    with pytest.raises(HeadsteerValueError, match="version 1.0"):
        Request.from_json('{"request": "patch", "version": 1.0}')
    with pytest.raises(HeadsteerValueError, match="duplicate key 'kind'"):
        Request.from_json('{"request": "patch", "kind": "q", "kind": "k"}')
    heads_file = tmp_path / "h.json"
    heads_file.write_text(json.dumps({"1": [0]}))
    for text in ("", str(heads_file)):
        with pytest.raises(HeadsteerValueError, match="heads: a request from JSON .* head file"):
            Request.from_json({"request": "ships", "heads": text})
    assert ShipsRequest(heads=str(heads_file)).heads == ((1, 0),)  # Python: a file path is fine
    with pytest.raises(HeadsteerValueError, match="head file not found: ''"):
        ShipsRequest(heads="")
    assert Request.from_json({"request": "ships", "heads": {"1": [0]}}).heads == ((1, 0),)


class _OptionsAccepted(Exception):
    """Raised right after a runner's `sweep_options` accepted its options (the test stops there)."""


def _inputs_for(name: str, model):
    """A small input of the right kind for request `name` (the run stops once its options pass)."""
    from heads.scorers.patching import pairs_from_tokens

    if name in ("patch", "path_patch", "direct_logit_attribution", "logit_lens", "knockout", "find_circuit"):
        return pairs_from_tokens([[40, 41, 42, 43]], [[40, 49, 42, 43]], [[20]], [[21]])
    if name in ("detect_roles", "composition_scores", "head_atlas"):
        return None
    if name == "maps_scores":
        return {"rel": [(5, 6), (7, 8)]}
    if name == "qrhead_scores":
        return [("q?", ["a b", "c d"], 0)]
    if name == "gate_heads":
        import torch

        from heads.scorers.gating import GateTask

        ids = torch.tensor([[40, 41, 42, 43]])
        return GateTask(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids))
    return ["a b c d", "e f g h"]


_REQUIRED = {"knockout": {"keys": [1]}, "qk_attribution": {"head": [0, 0]}}
"""The fields a request has no default for."""


@pytest.mark.parametrize("cls", sorted(RUNNERS, key=lambda c: c.NAME), ids=lambda c: c.NAME)
@pytest.mark.parametrize("progress", [False, True])
def test_every_request_runs_with_progress_on_or_off(cls, progress, tiny_llama, monkeypatch):
    """`SweepOptions(progress=...)` is never a bad value: every request accepts it through `run`
    (`headsteer run --quiet` passes progress=False to all of them)."""
    import sys

    from heads.engine import options as options_module

    real = options_module.sweep_options

    def checked(*args, **kwargs):
        real(*args, **kwargs)
        raise _OptionsAccepted

    for module in list(sys.modules.values()):
        if getattr(module, "sweep_options", None) is real and module is not options_module:
            monkeypatch.setattr(module, "sweep_options", checked)
    given = _inputs_for(cls.NAME, tiny_llama)
    args = () if given is None else (given,)
    try:
        request = cls(**_REQUIRED.get(cls.NAME, {}))
        run(tiny_llama, request, *args, options=SweepOptions(progress=progress))
    except _OptionsAccepted:
        pass


def test_an_option_refused_names_the_request(tiny_llama):
    """The message names the analysis the user called (the request's NAME), not an inner function."""
    with pytest.raises(HeadsteerValueError, match=r"^attribution_patching does not take shard="):
        run(tiny_llama, {"request": "attribution_patching"}, ["a b c"], options=SweepOptions(shard=(0, 2)))
