"""docs/errors.md shows the product's own messages: each listed error is raised here and its
message must appear on the page exactly as written (so the page cannot drift from the code)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from heads import (
    EditNeverFired,
    HeadModel,
    HeadScale,
    HeadsteerTypeError,
    HeadsteerValueError,
    MissingDependency,
    QueryScale,
    editing,
    encode_prompts,
    forward,
    load_model,
    span_attention,
)
from heads._util.files import check_output
from steer import SteeredModel

PAGE = Path(__file__).resolve().parents[1] / "docs/errors.md"


def _page_text() -> str:
    return PAGE.read_text(encoding="utf-8")


def _message(fn) -> str:
    with pytest.raises(
        (HeadsteerValueError, HeadsteerTypeError, EditNeverFired, MissingDependency, OSError)
    ) as e:
        fn()
    return str(e.value)


def _never_fired(model):
    with editing(model, [HeadScale(layer=0, heads=[0], factor=0.0)]):
        pass


def _flash(model):
    cfg = model.attention_configs[0]
    old = cfg._attn_implementation_internal
    cfg._attn_implementation_internal = "flash_attention_2"
    try:
        with editing(model, [QueryScale(layer=0, heads=[0], factor=0.5)]):
            pass
    finally:
        cfg._attn_implementation_internal = old


def test_every_listed_message_is_the_products(tiny_llama, tmp_path, monkeypatch):
    m = tiny_llama
    assert (m.n_layers, m.n_heads) == (3, 4)  # the page's messages name this geometry
    messages = [
        _message(lambda: editing(m, [HeadScale(layer=99, heads=[0])]).__enter__()),
        _message(lambda: editing(m, [HeadScale(layer=0, heads=[99])]).__enter__()),
        _message(lambda: HeadScale(layer=0, factor=float("nan"))),
        _message(lambda: _never_fired(m)),
        _message(lambda: _flash(m)),
        _message(lambda: encode_prompts(m.tokenizer, [""])),
        _message(lambda: span_attention(m, "hello world", emphasize="absent text")),
        _message(lambda: span_attention(m, "hello world")),
        _message(lambda: forward(m, encode_prompts(m.tokenizer, ["word " * 5000]))),
        _message(lambda: SteeredModel(m).generate("hi", max_new_tokens=-1)),
        _message(lambda: load_model(device="tpu")),
        _message(lambda: load_model("/nonexistent/folder")),
    ]
    wrap = _message(lambda: HeadModel("not a model"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.html").write_text("x")
    messages.append(_message(lambda: check_output("out/report.html")))
    os.symlink(tmp_path / "elsewhere.html", tmp_path / "out" / "link.html")
    link = _message(lambda: check_output("out/link.html"))
    messages.append(link.replace("out/link.html", "out/report.html"))
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    from heads.engine.executors import RayExecutor

    messages.append(_message(lambda: RayExecutor()._ray()))
    text = _page_text()
    missing = [msg for msg in messages if f"`{msg}`" not in text]
    assert not missing, "docs/errors.md lacks these messages as the product writes them:\n" + "\n".join(
        missing
    )
    assert wrap.startswith(
        re.search(r"`(cannot wrap a builtins\.str: expected [^`]*?), \.\.\.`", text).group(1)
    )
