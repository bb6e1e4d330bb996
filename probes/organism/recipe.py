"""The model organism's recipe: a small Llama-shaped model trained from scratch on this CPU.

`OrganismSpec` holds every choice (geometry, data mix, optimiser, checkpoint steps, seed,
threads); `train_organism` trains one and saves its checkpoints as ordinary Hugging Face
folders that `heads.load_model(path)` loads. Two specs ship (`ORGANISMS`):

* `attn-only`: 2 layers, 4 heads, d_model 128, no MLP (`intermediate_size: 0`, which the
  family table allows for Llama: `Family.attention_only`), the setting of Olsson et al. 2022's
  small attention-only models (they use learned positions; this one uses RoPE); 1,400 steps;
* `llama`: 4 layers, 4 query heads over 2 KV heads (GQA), d_model 128, a SwiGLU MLP of 512;
  1,000 steps.

Both read the embedded SmolLM2 tokenizer cut to 512 ids (`truncated_tokenizer`), rows of 64
tokens, 16 rows a step, 80 % repeated random segments and 20 % shipped corpus
(`probes.organism.data.batch_rows`), AdamW at 2e-3 after 100 warm-up steps.

Determinism: the weights are initialised from `torch.manual_seed(seed)`, each batch from
`(seed, step)`, and the run uses `torch.use_deterministic_algorithms(True)` with a fixed thread
count (`threads`), so the same spec gives bitwise the same checkpoints on the same CPU build of
torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from heads._util.progress import Progress, hf_progress_bars_off
from heads._util.validation import check_int, check_seed, is_number, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.model.loading import no_empty_init_warning
from probes.organism.data import CorpusStream, batch_rows
from probes.organism.tokenizer import MIN_VOCAB, truncated_tokenizer

__all__ = [
    "ATTN_ONLY",
    "CHECKPOINT_META",
    "LLAMA",
    "ORGANISMS",
    "OrganismSpec",
    "checkpoint_name",
    "train_organism",
]

CHECKPOINT_META = "headsteer_checkpoint.json"
"""The JSON file in each checkpoint folder: step, tokens seen, training loss, the spec."""


@dataclass(frozen=True)
class OrganismSpec:
    """Everything that fixes one organism run (frozen; JSON round-trip through `asdict`).

    Attributes:
        name: folder name of the run (letters, digits, `-`, `_`).
        n_layers: L.
        n_heads: H.
        d_model: D (a multiple of `n_heads`).
        n_kv_heads: KV heads (GQA), None: `n_heads`.
        d_mlp: the MLP width; 0: attention-only (no MLP).
        vocab_size: ids of the cut tokenizer (`MIN_VOCAB` .. 49152).
        context: tokens per training row (and the model's positions).
        steps: optimiser steps.
        batch: rows per step.
        lr: peak learning rate (AdamW, betas (0.9, 0.95)), reached after `warmup` steps of a
            linear warm-up and kept constant.
        warmup: warm-up steps.
        weight_decay: AdamW decay on the matrices (not on norms).
        repeat_fraction: share of rows that are repeated random segments (the rest: corpus).
        checkpoint_every: a checkpoint every so many steps, plus log-spaced ones early (1, 2, 5,
            10, 20, ...) and the last step; step 0 is the initialisation.
        seed: initialisation and data seed.
        threads: torch threads while training (the result depends on it bitwise).
    """

    name: str = "attn-only"
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_model: int = 128
    d_mlp: int = 0
    vocab_size: int = 512
    context: int = 64
    steps: int = 1400
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    repeat_fraction: float = 0.8
    checkpoint_every: int = 50
    seed: int = 0
    threads: int = 1
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (
            not isinstance(self.name, str)
            or not self.name
            or not all(c.isalnum() or c in "-_" for c in self.name)
        ):
            raise HeadsteerValueError(
                f"name must be letters, digits, '-' or '_', got {short_repr(self.name)}"
            )
        for f in (
            "n_layers",
            "n_heads",
            "d_model",
            "steps",
            "batch",
            "checkpoint_every",
            "threads",
            "context",
        ):
            check_int(f, getattr(self, f), lo=1)
        check_int("warmup", self.warmup, lo=0)
        check_int("d_mlp", self.d_mlp, lo=0)
        check_int("vocab_size", self.vocab_size, lo=MIN_VOCAB, hi=49152)
        check_int("context", self.context, lo=16, hi=4096)
        check_seed("seed", self.seed)
        kv = self.n_heads if self.n_kv_heads is None else check_int("n_kv_heads", self.n_kv_heads, lo=1)
        if self.n_heads % kv or self.d_model % self.n_heads:
            raise HeadsteerValueError(
                f"n_heads {self.n_heads} must divide d_model {self.d_model} and be a multiple of "
                f"n_kv_heads {kv}"
            )
        for f in ("lr", "weight_decay", "repeat_fraction"):
            v = getattr(self, f)
            if not is_number(v) or not math.isfinite(v) or v < 0:
                raise HeadsteerValueError(f"{f} must be a finite number >= 0, got {short_repr(v)}")
        if self.lr <= 0 or self.repeat_fraction > 1:
            raise HeadsteerValueError(
                f"need lr > 0 and repeat_fraction <= 1, got lr={self.lr!r}, "
                f"repeat_fraction={self.repeat_fraction!r}"
            )

    def to_dict(self) -> dict:
        """The spec as JSON-ready values."""
        d = asdict(self)
        d.pop("extra")
        return d

    @classmethod
    def from_dict(cls, data: dict) -> OrganismSpec:
        """The spec from `to_dict`'s output.

        Raises:
            HeadsteerTypeError: not a dict; HeadsteerValueError: an unknown field or a bad value.
        """
        if not isinstance(data, dict):
            raise HeadsteerTypeError(f"an organism spec must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)} - {"extra"}
        bad = sorted(set(data) - known)
        if bad:
            raise HeadsteerValueError(f"unknown organism spec field {short_repr(bad[0])}")
        return cls(**data)

    def checkpoint_steps(self) -> list[int]:
        """The steps saved: 0, log-spaced 1, 2, 5, 10, 20, ... below `checkpoint_every`, every
        `checkpoint_every`, and `steps`."""
        early = [m * 10**e for e in range(8) for m in (1, 2, 5) if m * 10**e < self.checkpoint_every]
        regular = range(0, self.steps + 1, self.checkpoint_every)
        return sorted({0, self.steps, *(s for s in early if s <= self.steps), *regular})

    def model_config(self) -> Any:
        """The `transformers.LlamaConfig` of this spec (`intermediate_size: 0` when `d_mlp == 0`)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.d_model,
            intermediate_size=self.d_mlp,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads or self.n_heads,
            max_position_embeddings=self.context,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )


ATTN_ONLY = OrganismSpec()
"""The 2-layer attention-only organism (the induction phase change)."""
LLAMA = OrganismSpec(
    name="llama",
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    d_mlp=512,
    steps=1000,
)
"""The small Llama-shaped organism (MLPs, GQA)."""
ORGANISMS = (ATTN_ONLY, LLAMA)
"""The specs `headsteer build organism` trains, in order."""


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint at `step` (`step-000100`)."""
    return f"step-{step:06d}"


@contextlib.contextmanager
def _deterministic(threads: int) -> Iterator[None]:
    """Fixed thread count and deterministic algorithms while training; restored on exit."""
    before_threads = torch.get_num_threads()
    before_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before_det)
        torch.set_num_threads(before_threads)


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(sum(kept) / len(kept)) if kept else None


def _save(model: Any, tokenizer: Any, folder: Path, meta: dict) -> None:
    with hf_progress_bars_off():  # no "Writing model shards" bar per checkpoint: progress is ours
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    (folder / CHECKPOINT_META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def train_organism(spec: OrganismSpec, folder: str | Path, *, progress: Progress | None = None) -> dict:
    """Train `spec` from scratch and save its checkpoints in `folder` (which must not exist).

    Writes `folder/step-NNNNNN/` per checkpoint step (a Hugging Face folder: `config.json`,
    `model.safetensors`, the tokenizer's files and `headsteer_checkpoint.json` with `step`,
    `tokens`, `train_loss` (the mean loss of the steps since the previous checkpoint),
    `train_loss_repeated` / `train_loss_text` (the same over the repeated-segment rows / the corpus
    rows only; None when there were none) and the spec), and `folder/training_log.json` (the loss
    of every step, overall and by row kind, the seconds taken).
    Callers that need an atomic result write into a temporary folder (`build_organism` does).

    Args:
        spec: the recipe.
        folder: where to write; it is created.
        progress: `(done, total)` in optimiser steps. transformers' own bars ("Writing model
            shards" per checkpoint) never show (`heads._util.progress.hf_progress_bars_off`).

    Returns:
        the training log (`losses` per step, `seconds`, `checkpoints`: the steps saved).

    Raises:
        HeadsteerValueError: `folder` exists.
    """
    from transformers import LlamaForCausalLM

    out = Path(folder)
    if out.exists():
        raise HeadsteerValueError(f"{out} exists: train_organism writes a new folder")
    out.mkdir(parents=True)
    tokenizer = truncated_tokenizer(spec.vocab_size)
    corpus = CorpusStream(tokenizer)
    saves = set(spec.checkpoint_steps())
    losses: list[float] = []
    t0 = time.perf_counter()
    with _deterministic(spec.threads):
        torch.manual_seed(spec.seed)
        with no_empty_init_warning():
            model = LlamaForCausalLM(spec.model_config())
        model.train()
        decay = [p for p in model.parameters() if p.ndim >= 2 and p.numel() > 0]
        rest = [p for p in model.parameters() if p.ndim < 2 and p.numel() > 0]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": spec.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=spec.lr,
            betas=(0.9, 0.95),
        )
        since: list[tuple[float, float | None, float | None]] = []
        by_kind: dict[str, list[float | None]] = {"repeated": [], "text": []}
        for step in range(spec.steps + 1):
            if step in saves:
                meta = {
                    "step": step,
                    "tokens": step * spec.batch * spec.context,
                    "train_loss": _mean([s[0] for s in since]),
                    "train_loss_repeated": _mean([s[1] for s in since]),
                    "train_loss_text": _mean([s[2] for s in since]),
                    "spec": spec.to_dict(),
                }
                model.eval()
                _save(model, tokenizer, out / checkpoint_name(step), meta)
                model.train()
                since = []
            if step == spec.steps:
                break
            for group in opt.param_groups:
                group["lr"] = spec.lr * min(1.0, (step + 1) / max(spec.warmup, 1))
            x, repeated = batch_rows(
                step,
                batch=spec.batch,
                context=spec.context,
                tokenizer=tokenizer,
                corpus=corpus,
                seed=spec.seed,
                repeat_fraction=spec.repeat_fraction,
            )
            logits = model(input_ids=x).logits
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="none"
            ).view(x.shape[0], -1)
            loss = nll.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            row = nll.detach().mean(1)
            losses.append(loss.item())
            by_kind["repeated"].append(row[repeated].mean().item() if repeated.any() else None)
            by_kind["text"].append(row[~repeated].mean().item() if (~repeated).any() else None)
            since.append((losses[-1], by_kind["repeated"][-1], by_kind["text"][-1]))
            if progress is not None:
                progress(step + 1, spec.steps)
    seconds = time.perf_counter() - t0
    log = {
        "spec": spec.to_dict(),
        "losses": losses,
        "losses_repeated": by_kind["repeated"],
        "losses_text": by_kind["text"],
        "seconds": seconds,
        "checkpoints": sorted(saves),
        "torch": torch.__version__,
    }
    (out / "training_log.json").write_text(json.dumps(log) + "\n", encoding="utf-8")
    return log
