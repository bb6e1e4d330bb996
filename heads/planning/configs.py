"""The transformers config a memory plan reads: a config, a `HeadModel`'s, or a model folder /
name's `config.json` (never a weight), its sizes checked to be given."""

from __future__ import annotations

from typing import Any

from heads._util.validation import short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__: list[str] = []  # internal: used by heads.planning.plan


def _config_of(config: object) -> Any:
    """The transformers config of `config` (see `plan_memory`), never reading a weight."""
    if hasattr(config, "to_dict") and hasattr(config, "model_type"):
        return config
    model = getattr(config, "model", None)  # a HeadModel
    if model is not None and hasattr(model, "config"):
        return model.config
    if config is None or isinstance(config, str) or hasattr(config, "__fspath__"):
        import os
        from pathlib import Path

        from transformers import AutoConfig

        from heads.model.loading import PACKAGED_MODELS, _resolve, check_config

        path = None if config is None else Path(os.fspath(config)).expanduser()
        if path is not None and path.is_dir():
            check_config(path)
            _check_sizes_given(path)
            return AutoConfig.from_pretrained(path, trust_remote_code=False)
        if config is None or str(config) in PACKAGED_MODELS:
            where, _ = _resolve(config)  # the embedded model's cache
            return AutoConfig.from_pretrained(where, trust_remote_code=False)
        if path is not None and path.exists():
            raise HeadsteerValueError(f"{str(config)!r} is not a model folder")
        if path is not None and (
            path.is_absolute() or str(config).startswith((".", "~")) or str(config).count("/") > 1
        ):
            raise HeadsteerValueError(f"no model folder at {str(config)!r}")
        try:
            return AutoConfig.from_pretrained(
                str(config), trust_remote_code=False
            )  # a hub id: config.json only
        except OSError as err:
            raise HeadsteerValueError(
                f"no model folder at {str(config)!r} and no hub config cached for it "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
            ) from None
    raise HeadsteerTypeError(
        f"config must be a transformers config, a HeadModel or a model folder, got {short_repr(config)}"
    )


_SIZE_FIELDS = (
    ("num_hidden_layers", "n_layer", "num_layers"),
    ("hidden_size", "n_embd", "d_model"),
    ("num_attention_heads", "n_head", "num_heads"),
)


def _check_sizes_given(folder: Any) -> None:
    """Refuse a folder's config.json that leaves a size to transformers' defaults (a bare
    `{"model_type": "llama"}` would be planned as a 7B model)."""
    import json

    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # check_config named it already
    if not isinstance(raw, dict):
        return
    sub = raw.get("text_config")
    text: dict = sub if isinstance(sub, dict) else raw
    for names in _SIZE_FIELDS:
        if not any(n in text or n in raw for n in names):
            raise HeadsteerValueError(
                f"config.json in {str(folder)!r} does not give {names[0]}: a plan needs the model's own "
                "sizes, not transformers' defaults"
            )
