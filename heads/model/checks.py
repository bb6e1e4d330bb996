"""The checks `load_model` makes before any weight is read: the load options (`dtype`, `device`,
`device_map`) and the model folder (no custom code, a config headsteer can rely on, safetensors
weights only); and, once the weights are in, that they fit the model and are finite floats."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import cast

import torch

from heads._util.validation import is_number, parse_json, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError

__all__ = [
    "DEVICE_MAP_STRATEGIES",
    "DTYPES",
    "WeightMismatchWarning",
    "check_config",
    "check_dtype",
    "check_no_remote_code",
    "check_weights",
    "check_weights_values",
]


DTYPES = ("float32", "bfloat16", "float16")
"""Weight dtypes `load_model` (and the CLI's `--dtype`) accept, by torch name."""
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""The string `device_map`s (accelerate's placement strategies)."""


def check_dtype(dtype: str | torch.dtype, *, option: str = "dtype") -> torch.dtype:
    """The torch dtype named by `dtype` (a name in `DTYPES` or that torch dtype).

    Raises:
        ValueError: any other value (`"float8"`, `""`, `"Float32"`, `torch.float8_e4m3fn`, ...),
            naming it and the allowed names.
    """
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name in DTYPES:
            return dtype
    elif isinstance(dtype, str) and dtype in DTYPES:
        return cast(torch.dtype, getattr(torch, dtype))
    raise HeadsteerValueError(f"{option} must be one of {', '.join(DTYPES)}, got {short_repr(dtype)}")


_CODE_KEYS = ("auto_map",)
_CONFIG_FILES = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "image_processor_config.json",
    "generation_config.json",
)


def check_no_remote_code(folder: str | os.PathLike) -> None:
    """Refuse a model folder that asks for custom code, before transformers reads it.

    headsteer never runs a model folder's Python (`trust_remote_code` is always False, so
    transformers never asks "Do you wish to run the custom code?" either).

    Raises:
        ValueError: a config file of the folder has an `auto_map` (custom classes), naming the
            file and what it maps; or a config file that is not a JSON object, not valid JSON
            (`"cannot read the model in '<folder>': 'config.json' is not valid JSON: ... (line L,
            column C)"`) or holds an integer of more than 4300 digits (`"... a number in
            'config.json' is too large ..."`).
    """
    path = Path(folder)
    for name in _CONFIG_FILES:
        f = path / name
        if not f.is_file():
            continue
        try:
            data = parse_json(f.read_bytes(), repr(name))  # one line: not JSON, a number too large
        except OSError as err:
            raise HeadsteerValueError(
                f"cannot read the model in {str(folder)!r}: {name} cannot be read ({err.strerror or err})"
            ) from None
        except HeadsteerValueError as err:
            raise HeadsteerValueError(f"cannot read the model in {str(folder)!r}: {err}") from None
        if not isinstance(data, dict):
            raise HeadsteerValueError(
                f"cannot read the model in {str(folder)!r}: {name} is not a JSON object"
            )
        for key in _CODE_KEYS:
            if data.get(key):
                what = ", ".join(sorted(map(str, data[key])))[:120] if isinstance(data[key], dict) else "code"
                raise HeadsteerValueError(
                    f"{str(f)!r} asks for custom code ({key}: {what}): headsteer never runs a model "
                    "folder's Python; use a model whose architecture transformers ships"
                )


_POSITIVE_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
_OPTIONAL_POSITIVE = ("head_dim", "num_key_value_heads", "intermediate_size", "max_position_embeddings")
_FIELD_MAX = {
    # far above any real model; a config beyond them would only hang building the modules
    "num_hidden_layers": 10_000,
    "num_attention_heads": 10_000,
    "num_key_value_heads": 10_000,
    "head_dim": 100_000,
    "hidden_size": 1_000_000,
    "intermediate_size": 10_000_000,
    "vocab_size": 100_000_000,
    "max_position_embeddings": 1_000_000_000,
}
_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")


def _attention_only(model_type: object) -> bool:
    """Whether `model_type`'s family accepts `intermediate_size: 0` (`Family.attention_only`)."""
    from heads.model.families import FAMILIES

    fam = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    return fam is not None and fam.attention_only


def check_config(folder: str | os.PathLike) -> None:
    """Read a model folder's config (no custom code) and check the fields headsteer relies on.

    Raises:
        ValueError: "cannot read the model: ..." naming the field: a count that is not a
            positive int (`num_attention_heads: 0`, `num_hidden_layers: 0`, `head_dim: 0`;
            `intermediate_size: 0` is accepted only for a family marked `attention_only`,
            Llama), heads that do not divide the KV heads, a config.json that is not valid JSON or
            holds an integer of more than 4300 digits (`parse_json`'s line), or a config
            transformers cannot parse (e.g. an unknown `rope_scaling.rope_type`), with its
            first line.
    """
    from transformers import AutoConfig

    try:
        raw = parse_json((Path(folder) / "config.json").read_bytes(), "'config.json'")
    except OSError:  # a missing config.json: transformers names it
        raw = {}
    except HeadsteerValueError as err:  # one line: not JSON (line, column), a number too large
        raise HeadsteerValueError(f"cannot read the model in {str(folder)!r}: {err}") from None
    raws = [raw] + (
        [raw["text_config"]] if isinstance(raw, dict) and isinstance(raw.get("text_config"), dict) else []
    )
    for cfg_raw in raws if isinstance(raw, dict) else []:  # before transformers divides by them
        for key in (*_POSITIVE_FIELDS, *_OPTIONAL_POSITIVE):
            value = cfg_raw.get(key)
            if key == "intermediate_size" and value == 0 and _attention_only(cfg_raw.get("model_type")):
                continue
            if (
                key in cfg_raw
                and value is not None
                and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
            ):
                raise HeadsteerValueError(
                    f"cannot read the model in {str(folder)!r}: {key} must be a positive int, got "
                    f"{short_repr(value)}"
                )
            if key in cfg_raw and value is not None and value > _FIELD_MAX[key]:
                raise HeadsteerValueError(
                    f"cannot read the model in {str(folder)!r}: {key} {short_repr(value)} is beyond "
                    f"any real model (at most {_FIELD_MAX[key]:,})"
                )
        for key in _EPS_FIELDS:
            value = cfg_raw.get(key)
            if value is not None and not (is_number(value) and math.isfinite(value) and value > 0):
                raise HeadsteerValueError(
                    f"cannot read the model in {str(folder)!r}: {key} must be a finite number > 0, "
                    f"got {short_repr(value)}"
                )
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except HeadsteerValueError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a damaged config
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HeadsteerValueError(f"cannot read the model in {str(folder)!r}: {first}") from None
    texts = [config]
    text_config = getattr(config, "text_config", None)
    if text_config is not None:
        texts = [text_config]
    for cfg in texts:
        for key in (*_POSITIVE_FIELDS, *_OPTIONAL_POSITIVE):
            if key not in _POSITIVE_FIELDS and getattr(cfg, key, None) is None:
                continue
            if not hasattr(cfg, key):
                continue
            value = getattr(cfg, key)
            if (
                key == "intermediate_size"
                and value == 0
                and _attention_only(getattr(cfg, "model_type", None))
            ):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HeadsteerValueError(
                    f"cannot read the model in {str(folder)!r}: {key} must be a positive int, got "
                    f"{short_repr(value)}"
                )
        heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
        if isinstance(heads, int) and isinstance(kv, int) and kv >= 1 and heads % kv:
            raise HeadsteerValueError(
                f"cannot read the model in {str(folder)!r}: num_attention_heads {heads} is not a "
                f"multiple of num_key_value_heads {kv}"
            )
        rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None)
        if isinstance(rope, dict):
            kind = rope.get("rope_type", rope.get("type"))
            if kind is not None:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
                    raise HeadsteerValueError(
                        f"cannot read the model in {str(folder)!r}: unknown rope_scaling rope_type "
                        f"{short_repr(kind)} (known: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})"
                    )


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def check_weights(folder: str | os.PathLike) -> None:
    """Refuse a model folder whose weights are not safetensors, before anything is read.

    Raises:
        ValueError: the folder holds only pickled weights (`pytorch_model.bin`, `.pt`,
            ...; headsteer never loads pickles: unpickling can run code), or no
            weights at all. The message names the folder and the files.
    """
    path = Path(folder)
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
    if pickles:
        raise HeadsteerValueError(
            f"{str(folder)!r} holds only pickled weights ({', '.join(pickles)}); headsteer never loads "
            "pickles (unpickling can run code): convert them to safetensors first"
        )
    raise HeadsteerValueError(f"{str(folder)!r} holds no model weights (no *.safetensors file)")


class WeightMismatchWarning(UserWarning):
    """A checkpoint loaded with `allow_weight_mismatch=True` lacks tensors or has extra ones."""


def check_weights_values(where: str | os.PathLike, model: torch.nn.Module) -> None:
    """Refuse weights a model cannot compute with: a parameter that is not floating point (an
    int64 tensor saved under a weight's name) or holds NaN / inf.

    Raises:
        ValueError: one line naming the folder and the first such tensor.
    """
    from safetensors import safe_open

    folder = Path(where)
    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        with safe_open(str(f), "pt") as st:  # the header only: transformers casts on load
            for name in st.keys():
                kind = st.get_slice(name).get_dtype()
                if name.endswith((".weight", ".bias")) and not kind.startswith(("F", "BF")):
                    raise HeadsteerValueError(
                        f"cannot read the model in {str(where)!r}: {name} is stored as {kind}, not a "
                        "floating-point tensor"
                    )
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            continue
        if not param.dtype.is_floating_point:
            kind = str(param.dtype).replace("torch.", "")
            raise HeadsteerValueError(
                f"cannot read the model in {str(where)!r}: {name} is {kind}, not a floating-point tensor"
            )
        if not bool(torch.isfinite(param).all()):
            raise HeadsteerValueError(
                f"cannot read the model in {str(where)!r}: {name} holds NaN or inf values"
            )


def _check_loading_info(where: str, info: dict, allow: bool) -> None:
    """Refuse (or, with `allow`, warn about) missing, unexpected or mismatched tensors."""
    import warnings

    problems = []
    for key, what in (
        ("missing_keys", "missing (transformers would initialise them at random)"),
        ("unexpected_keys", "unexpected (in the checkpoint, not in the model)"),
        ("mismatched_keys", "of the wrong shape"),
    ):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            problems.append(f"{len(names)} tensor(s) {what}: {shown}")
    if not problems:
        return
    text = f"the checkpoint in {where!r} does not fit its model: " + "; ".join(problems)
    if not allow:
        raise HeadsteerValueError(
            f"cannot read the model: {text} (load_model(allow_weight_mismatch=True), the CLI's "
            "--allow-weight-mismatch or HEADSTEER_ALLOW_WEIGHT_MISMATCH=1 loads it anyway)"
        )
    warnings.warn(f"WARNING: {text}", WeightMismatchWarning, stacklevel=3)


def _check_map_device(key: str, value: object) -> None:
    """ValueError unless `value` is a device accelerate can place module `key` on here."""
    _check_device(value, f"device_map[{key!r}] = {value!r}", disk=True)


def _check_device(value: object, where: str, *, disk: bool = False) -> None:
    """ValueError unless `value` is a usable device here (cpu, an existing cuda:N, an available
    mps; `"disk"` too when `disk`): never meta, which holds no weights."""
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise HeadsteerValueError(f"{where}: a device is a string (cpu, cuda:N, mps, disk) or a GPU index")
    if disk and value == "disk":
        return
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        kinds = "cpu, cuda:N, mps, disk" if disk else "cpu, cuda, cuda:N, mps"
        raise HeadsteerValueError(f"{where} is not a torch device ({kinds})") from None
    if dev.type == "meta":
        raise HeadsteerValueError(f"{where}: the meta device holds no weights; use cpu, cuda:N, mps or disk")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise HeadsteerValueError(f"{where}: use cpu, cuda:N, mps or disk")
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        index = 0 if dev.index is None else dev.index
        if index >= count:
            seen = f"cuda:0..cuda:{count - 1}" if count else "none"
            raise HeadsteerValueError(f"{where}: no such GPU here (visible: {seen})")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise HeadsteerValueError(f"{where}: mps is not available here")


def _check_device_map_values(device_map: object, offload_folder: object) -> None:
    """Refuse a malformed `device_map` (type, empty, strategy, devices, disk without a folder)."""
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_STRATEGIES:
            raise HeadsteerValueError(
                f"device_map {short_repr(device_map)} is not a strategy "
                f"({', '.join(DEVICE_MAP_STRATEGIES)}); "
                "for one device use device=, for a placement pass a dict {module name: device}"
            )
        return
    if not isinstance(device_map, dict):
        raise HeadsteerTypeError(
            f"device_map must be a strategy string ('auto') or a dict {{module name: device}}, "
            f"got {short_repr(device_map)} ({type(device_map).__name__})"
        )
    if not device_map:
        raise HeadsteerValueError("device_map {} is empty: name a device for each module, or use 'auto'")
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise HeadsteerValueError(f"device_map key {short_repr(key)} is not a module name (a string)")
        _check_map_device(key, value)
    disk = [k for k, v in device_map.items() if v == "disk"]
    if disk and offload_folder is None:
        raise HeadsteerValueError(
            f"device_map puts {short_repr(disk[0])} on 'disk': pass offload_folder= for its weights"
        )


def _check_device_map(where: str, device_map: dict) -> None:
    """ValueError naming the first key of `device_map` that is no module or parameter of the model.

    The names come from the model built with empty (meta) weights from its config, so nothing
    is read but the config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(where, trust_remote_code=False)
        )
    known = {n for n, _ in skeleton.named_modules()} | {n for n, _ in skeleton.named_parameters()}
    unknown = [k for k in device_map if k not in known]
    if unknown:
        top = sorted({n.split(".")[0] for n in known if n})
        raise HeadsteerValueError(
            f"device_map names {short_repr(unknown[0])}, which is no module of this model "
            f"(top-level modules: {', '.join(top)}; use names from model.named_modules())"
        )
