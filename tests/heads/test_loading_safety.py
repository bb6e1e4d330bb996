"""Loading runs no one's code, never loads a partly random model silently, reads damaged configs
as one-line errors, and answers hub names from the local cache or at once."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from heads import load_model
from heads.errors import HeadsteerValueError
from heads.model.loading import WeightMismatchWarning


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_auto_map_is_refused_before_transformers_sees_the_folder(tiny_llama_dir, tmp_path, monkeypatch):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    marker = tmp_path / "ran"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    _edit_config(folder, model_type="evilmodel", auto_map={"AutoModelForCausalLM": "evil.EvilModel"})
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("y\n" * 10))  # a `yes |` user
    with pytest.raises(HeadsteerValueError, match="custom code") as info:
        load_model(folder)
    assert "\n" not in str(info.value) and "config.json" in str(info.value)
    assert not marker.exists()
    from heads import load_tokenizer

    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    shutil.copy(Path(tiny_llama_dir) / "config.json", folder / "config.json")
    tok_cfg["auto_map"] = {"AutoTokenizer": ["evil.Tok", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(HeadsteerValueError, match="tokenizer_config.json.*custom code"):
        load_tokenizer(folder)
    assert not marker.exists()


def _rewrite_weights(folder: Path, drop: str | None = None, add: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(f)
    if drop is not None:
        del tensors[drop]
    if add is not None:
        tensors[add] = torch.zeros(3)
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor_is_an_error_or_a_loud_warning(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    key = "model.layers.1.self_attn.q_proj.weight"
    _rewrite_weights(folder, drop=key)
    with pytest.raises(HeadsteerValueError, match="missing.*layers.1.self_attn.q_proj") as info:
        load_model(folder)
    assert "\n" not in str(info.value)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hm = load_model(folder, allow_weight_mismatch=True)
    msgs = [str(w.message) for w in seen if issubclass(w.category, WeightMismatchWarning)]
    assert len(msgs) == 1 and key in msgs[0]
    assert hm.n_layers == 3


def test_unexpected_tensor_is_an_error(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _rewrite_weights(folder, add="model.layers.1.self_attn.extra.weight")
    with pytest.raises(HeadsteerValueError, match="unexpected.*extra.weight"):
        load_model(folder)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"head_dim": 0}, "head_dim"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "nope", "factor": 2.0}}, "nope"),
        ({"num_hidden_layers": 10**12}, "num_hidden_layers 1000000000000 is beyond any real model"),
        ({"rms_norm_eps": 0}, "rms_norm_eps must be a finite number > 0"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps must be a finite number > 0"),
    ],
)
def test_damaged_config_is_one_value_error(tiny_llama_dir, tmp_path, changes, needle):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(folder, **changes)
    with pytest.raises(HeadsteerValueError, match="cannot read the model") as info:
        load_model(folder)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_damaged_config_in_the_cli_exits_2_with_one_line(tiny_llama_dir, tmp_path):
    from typer.testing import CliRunner

    from viz.cli.main import app

    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(folder, num_attention_heads=0)
    res = CliRunner().invoke(app, ["generate", "--model", str(folder), "the **key** is"])
    assert res.exit_code == 2, res.output
    text = res.output  # stdout and stderr together
    lines = [ln for ln in text.splitlines() if "cannot read the model" in ln]
    assert len(lines) == 1 and "Traceback" not in text, text


def test_cli_allow_weight_mismatch_flag_loads_with_one_warning(tiny_llama_dir, tmp_path, monkeypatch):
    """Without the flag a checkpoint missing a tensor exits 2 naming it and the flag; with
    `--allow-weight-mismatch` (or the environment variable) it runs, warning once."""
    from typer.testing import CliRunner

    from viz.cli.main import app

    folder = _copy(tiny_llama_dir, tmp_path / "m")
    _rewrite_weights(folder, drop="model.layers.1.self_attn.q_proj.weight")
    monkeypatch.delenv("HEADSTEER_ALLOW_WEIGHT_MISMATCH", raising=False)
    args = ["generate", "--model", str(folder), "--max-new-tokens", "2", "the **key** is"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "--allow-weight-mismatch" in res.output, res.output
    for extra, env in (["--allow-weight-mismatch"], None), ([], "1"):
        if env is not None:
            monkeypatch.setenv("HEADSTEER_ALLOW_WEIGHT_MISMATCH", env)
        res = CliRunner().invoke(app, [*args[:1], *extra, *args[1:]])
        assert res.exit_code == 0, res.output
        warned = [ln for ln in res.output.splitlines() if "q_proj" in ln]
        assert len(warned) == 1 and "missing" in warned[0], res.output


def test_hub_name_without_cache_or_network_fails_at_once(tmp_path, monkeypatch):
    """Not cached and offline: refused without opening a connection; not cached and the hub
    unreachable: one connection probe, then refused, without the hub client (whose retries
    took minutes). Counted, not timed."""
    import socket

    import huggingface_hub
    from huggingface_hub import constants

    connects: list = []
    downloads: list = []
    real_snapshot = huggingface_hub.snapshot_download

    def connect(address, *a, **k):
        connects.append(tuple(address))
        raise OSError("no network in this test")

    def snapshot(*a, **k):
        downloads.append(bool(k.get("local_files_only")))
        return real_snapshot(*a, **k)

    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert connects == [] and downloads == [True]  # the cache only
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: no network
    with pytest.raises(FileNotFoundError, match="cannot be reached"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert connects == [("127.0.0.1", 9)] and downloads == [True, True]  # one probe, no online download


def test_hub_name_in_the_local_cache_loads_from_it(tiny_llama_dir, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    repo = hub / "models--someone--tiny"
    _copy(tiny_llama_dir, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hm = load_model("someone/tiny")
    assert hm.name == "someone/tiny" and hm.n_layers == 3


@pytest.mark.parametrize("bad", ["int64", "nan"])
def test_weights_that_cannot_compute_are_refused(tiny_llama_dir, tmp_path, bad):
    """An int64 tensor under a weight's name, or NaN weights, loaded silently (found by a breaker)."""
    from safetensors.torch import load_file, save_file

    folder = _copy(tiny_llama_dir, tmp_path / "m")
    f = folder / "model.safetensors"
    tensors = load_file(f)
    key = next(k for k in tensors if k.endswith("q_proj.weight"))
    if bad == "int64":
        tensors[key] = tensors[key].to(torch.int64)
    else:
        tensors[key][0, 0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(
        HeadsteerValueError, match="stored as I64, not a floating-point tensor|holds NaN or inf"
    ) as info:
        load_model(folder)
    assert "\n" not in str(info.value)


def test_a_folder_without_tokenizer_files_is_one_line(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path / "m")
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            f.unlink()
    with pytest.raises(HeadsteerValueError, match=r"has no tokenizer \(none of tokenizer.json") as info:
        load_model(folder)
    assert "\n" not in str(info.value)
