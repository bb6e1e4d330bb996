"""Sharded execution of head sweeps: in this process (`"local"`) or as Ray tasks (`"ray"`).

A head sweep (Ships, dataset-level Ships, PASTA profiling, ACT calibration) is
embarrassingly parallel over heads: the scorer splits its heads into `n` shards (its
`shard=(i, n)` or `heads=` argument), the executor runs one call per shard and the
scorer merges the parts (`heads.scorers.safety.ships.merge_scores`, NaN = not scored in that shard).

With Ray, each task gets a `ModelSpec` (how to load the model), never the model: a
worker process loads it once and keeps it for the next shards it runs. A task whose
worker dies is retried (`max_retries`), so no shard is lost. Ray is an optional extra
(`pip install 'headsteer[ray]'`), imported only inside `RayExecutor`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from heads._util.validation import check_int, check_number, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError, MissingDependency
from heads.model.adapter import HeadModel
from heads.model.loading import EMBEDDED_MODEL, load_model

__all__ = [
    "Executor",
    "LocalExecutor",
    "ModelSpec",
    "RayExecutor",
    "merge_tables",
    "resolve_executor",
    "run_head_shards",
    "run_shards",
]


@dataclass(frozen=True)
class ModelSpec:
    """How a worker loads the model (picklable, small; the model itself never travels).

    Attributes:
        name_or_path: as `heads.load_model` (None = the embedded model).
        dtype: torch dtype name (default "float32").
        attn_implementation: "sdpa" (default) or "eager".
        loader: optional zero-argument callable returning a `HeadModel`, used instead
            (must be importable by the workers, e.g. a module-level function).
    """

    name_or_path: str | None = None
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    loader: Callable[[], HeadModel] | None = None

    @classmethod
    def of(cls, model: HeadModel) -> ModelSpec:
        """The spec that reloads `model` (the embedded model, or the folder it was loaded from).

        Raises:
            ValueError: a model built in memory (its name is no folder): pass a `ModelSpec`.
        """
        attn = getattr(model.model.config, "_attn_implementation", "sdpa") or "sdpa"
        dtype = str(model.dtype).removeprefix("torch.")
        if model.name == EMBEDDED_MODEL:
            return cls(None, dtype, attn)
        if Path(model.name).expanduser().joinpath("config.json").is_file():
            return cls(str(Path(model.name).expanduser().resolve()), dtype, attn)
        raise HeadsteerValueError(
            f"model {short_repr(model.name)} was not loaded from a folder, so workers cannot reload it: "
            "pass model=ModelSpec(...) with a path or a loader"
        )

    def load(self) -> HeadModel:
        """Load the model this spec describes."""
        if self.loader is not None:
            return self.loader()
        return load_model(
            self.name_or_path, dtype=getattr(torch, self.dtype), attn_implementation=self.attn_implementation
        )


_WORKER_MODELS: dict[ModelSpec, HeadModel] = {}


Target = Callable[..., Any]
"""A scorer function `target(model, **kwargs)`: a module-level function, so that Ray pickles it
by reference (its module and name) and a worker imports it: a moved function keeps working."""


def _check_target(target: object) -> Target:
    """`target` if it is a callable (a function object, never a `"module:function"` string).

    Raises:
        HeadsteerTypeError: a string or another non-callable.
    """
    if isinstance(target, str) or not callable(target):
        raise HeadsteerTypeError(f"target must be a function (the scorer itself), got {short_repr(target)}")
    return target


def _run_shard(spec: ModelSpec, target: Target, kwargs: dict) -> Any:
    """Ray task body: load the model once per worker process, run one shard."""
    model = _WORKER_MODELS.get(spec)
    if model is None:
        model = _WORKER_MODELS[spec] = spec.load()
    return target(model, **kwargs)


def _count(n: int, what: str) -> int:
    check_int(what, n, lo=1)
    return int(n)


class Executor:
    """Runs one scorer call per shard. Subclasses implement `n_shards` and `map`."""

    def n_shards(self) -> int:
        """How many shards to split a sweep into."""
        raise NotImplementedError

    def map(self, target: Target, model: HeadModel | ModelSpec, calls: Sequence[dict]) -> list:
        """`[target(model, **kw) for kw in calls]`, in order (possibly in parallel)."""
        raise NotImplementedError


class LocalExecutor(Executor):
    """Shards run one after another in this process, on the given model.

    Args:
        n_shards: shards per sweep (default 1).
    """

    def __init__(self, n_shards: int = 1):
        self._n = _count(n_shards, "n_shards")

    def n_shards(self) -> int:
        return self._n

    def map(self, target: Target, model: HeadModel | ModelSpec, calls: Sequence[dict]) -> list:
        if isinstance(model, ModelSpec):
            model = model.load()
        return [target(model, **kw) for kw in calls]


class RayExecutor(Executor):
    """Shards run as Ray tasks; each worker loads the model once (from a `ModelSpec`).

    Args:
        address: None = the Ray cluster this process is connected to (`ray.init` already
            called), else `"local"` (start one on this machine) or a cluster address
            (`"auto"`, `"ray://host:10001"`, `"host:6379"`).
        n_shards: shards per sweep (default: the cluster's CPU count).
        max_retries: times a task is re-run when its worker dies (default 3).
        num_cpus: CPUs reserved per task (default 1).
        spec: the `ModelSpec` workers load (default `ModelSpec.of(model)`: the embedded
            model or the folder the model came from).

    Raises:
        ValueError: bad counts; ImportError with the install line when Ray is missing.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        n_shards: int | None = None,
        max_retries: int = 3,
        num_cpus: float = 1,
        spec: ModelSpec | None = None,
    ):
        if spec is not None and not isinstance(spec, ModelSpec):
            raise HeadsteerTypeError(f"spec must be a ModelSpec, got {short_repr(spec)}")
        self.address = address
        self.spec = spec
        self._n = None if n_shards is None else _count(n_shards, "n_shards")
        check_int("max_retries", max_retries, lo=0)
        check_number("num_cpus", num_cpus, lo=0, lo_open=True, finite=False, what="> 0")
        self.max_retries: int = int(max_retries)
        self.num_cpus: float = float(num_cpus)

    def _ray(self):
        try:
            import ray
        except ImportError:
            raise MissingDependency("executor='ray' needs Ray: pip install 'headsteer[ray]'") from None
        if not ray.is_initialized():
            # Workers must import this checkout of headsteer (also when it is not installed).
            root = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            env = {"env_vars": {"PYTHONPATH": path, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}}
            if self.address in (None, "local"):
                ray.init(include_dashboard=False, runtime_env=env, log_to_driver=False)
            else:
                ray.init(address=self.address, runtime_env=env, log_to_driver=False)
        return ray

    def n_shards(self) -> int:
        if self._n is not None:
            return self._n
        cpus = self._ray().cluster_resources().get("CPU", 1)
        return max(1, int(math.floor(cpus / self.num_cpus)))

    def map(self, target: Target, model: HeadModel | ModelSpec, calls: Sequence[dict]) -> list:
        spec = model if isinstance(model, ModelSpec) else (self.spec or ModelSpec.of(model))
        ray = self._ray()
        task = ray.remote(num_cpus=self.num_cpus, max_retries=self.max_retries)(_run_shard)
        results: list = ray.get([task.remote(spec, target, dict(kw)) for kw in calls])
        return results


def resolve_executor(executor: str | Executor) -> Executor:
    """`"local"` -> `LocalExecutor()`, `"ray"` -> `RayExecutor()` (the connected cluster, or a
    new local one), an `Executor` as is.

    Raises:
        ValueError: any other value.
    """
    if isinstance(executor, Executor):
        return executor
    if executor == "local":
        return LocalExecutor()
    if executor == "ray":
        return RayExecutor()
    raise HeadsteerValueError(f"executor must be 'local', 'ray' or an Executor, got {short_repr(executor)}")


def run_shards(
    target: Target,
    model: HeadModel | ModelSpec,
    executor: str | Executor,
    shard_kwargs: Callable[[int, int], dict],
    *,
    max_shards: int | None = None,
) -> list:
    """Run `target(model, **shard_kwargs(i, n))` for every shard i of n with `executor`.

    Args:
        target: the scorer function itself (module-level, so Ray pickles it by reference;
            called with `executor=None` in the shard).
        model: the model (or the spec workers load it from).
        executor: `"local"`, `"ray"` or an `Executor`.
        shard_kwargs: keyword arguments of shard i of n.
        max_shards: at most this many shards (e.g. the number of heads, so none is empty).

    Returns:
        the n results, in shard order.
    """
    target = _check_target(target)
    ex = resolve_executor(executor)
    n = ex.n_shards() if max_shards is None else max(1, min(ex.n_shards(), max_shards))
    return ex.map(target, model, [shard_kwargs(i, n) for i in range(n)])


def run_head_shards(
    target: Target, model: HeadModel | ModelSpec, executor: str | Executor, kwargs: dict, heads: Sequence
) -> list:
    """`run_shards` with the heads dealt round-robin: shard i of n runs `target(model, **kwargs,
    heads=heads[i::n])`; at most `len(heads)` shards (none empty). The n results, in shard order."""
    return run_shards(
        target, model, executor, lambda i, n: dict(kwargs, heads=heads[i::n]), max_shards=len(heads)
    )


def merge_tables(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """NaN-merge of per-shard tables of one shape (NaN = not scored in that shard).

    Raises:
        ValueError: no parts, different shapes, or an entry set in two parts.
    """
    if not parts:
        raise HeadsteerValueError("no shards to merge")
    out = torch.full_like(parts[0], math.nan)
    for p in parts:
        if p.shape != out.shape:
            raise HeadsteerValueError(f"shards differ in shape: {tuple(p.shape)} vs {tuple(out.shape)}")
        seen = ~torch.isnan(p)
        if (seen & ~torch.isnan(out)).any():
            raise HeadsteerValueError("an entry is scored in two shards")
        out[seen] = p[seen]
    return out
