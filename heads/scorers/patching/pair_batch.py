"""The pair types of causal analysis: `PromptPair` (a clean / corrupted prompt pair as text)
and `PairBatch` (pairs encoded to aligned, left-padded token rows). How pairs are encoded and
checked: `heads.scorers.patching.pairs`."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from heads._util.validation import check_seed, short_repr
from heads.errors import HeadsteerTypeError, HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts

__all__ = ["Answer", "PairBatch", "PromptPair"]

Answer = str | int | Sequence[str | int]


@dataclass(frozen=True)
class PromptPair:
    """One clean / corrupted pair.

    Attributes:
        clean: the clean prompt (plain text; rendered without a chat template by default).
        corrupted: the corrupted prompt; must tokenize to the same length as `clean`.
        answer: the correct token(s): a string (single token, usually with its leading
            space, e.g. `" Mary"`), a token id, or a list of them.
        counterfactual: the counterfactual token(s), same forms; None when the metric
            does not need one (log-prob, prob, KL).
        meta: free JSON-serialisable fields (template, split, ...).
        positions: named positions of the clean prompt, `{name: [start, end]}` half-open
            character spans (or a substring: its first occurrence), e.g. IOI's
            `{"IO": [10, 14], "S1": [..], "S2": [..]}`; `encode_pairs` maps each to the token
            holding the span's last character (`PairBatch.positions`). `END` (the last token)
            is implicit. The corrupted prompt shares the token columns.
    """

    clean: str
    corrupted: str
    answer: Answer
    counterfactual: Answer | None = None
    meta: dict = field(default_factory=dict)
    positions: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "pair") -> PromptPair:
        """A pair from a JSON record with keys `clean`, `corrupted`, `answer`, optional
        `counterfactual` and `positions`; other keys go to `meta`.

        Raises:
            ValueError: a missing key or a non-string prompt.
        """
        if not isinstance(d, Mapping):
            raise HeadsteerTypeError(f"{where}: a pair is a JSON object, got {type(d).__name__}")
        missing = [k for k in ("clean", "corrupted", "answer") if k not in d]
        if missing:
            raise HeadsteerValueError(f"{where}: missing key(s) {missing} (need clean, corrupted, answer)")
        own = ("clean", "corrupted", "answer", "counterfactual", "positions")
        meta = {k: v for k, v in d.items() if k not in own}
        positions = d.get("positions") or {}
        if not isinstance(positions, Mapping):
            raise HeadsteerValueError(f"{where}: positions must be a mapping, got {short_repr(positions)}")
        return cls(d["clean"], d["corrupted"], d["answer"], d.get("counterfactual"), meta, dict(positions))

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"clean": self.clean, "corrupted": self.corrupted, "answer": self.answer}
        if self.counterfactual is not None:
            out["counterfactual"] = self.counterfactual
        if self.positions:
            out["positions"] = dict(self.positions)
        return {**out, **self.meta}


@dataclass(repr=False)
class PairBatch:
    """Encoded pairs: N clean rows and N corrupted rows, left-padded to one width T.

    Attributes:
        clean_ids: `[N, T]` long, left-padded clean prompts.
        corrupted_ids: `[N, T]` long, the corrupted prompts (same padding as the clean row).
        attention_mask: `[N, T]` long, 0 on padding (shared: each pair has one length).
        answers: `[N, A]` long answer ids (A = most answers of any pair; padding slots 0).
        answer_mask: `[N, A]` bool, True on real answer slots (at least one per pair).
        counterfactuals: `[N, C]` long counterfactual ids (C >= 1; all-False mask when absent).
        counterfactual_mask: `[N, C]` bool.
        pairs: the source `PromptPair`s (None entries when built from token ids).
        tokens: per pair, the clean row's tokens as readable text (unpadded; `␣to`, not the
            tokenizer's `Ġto`: `heads.inputs.tokens.readable_tokens`), for labels.
        positions: named positions, `{name: [N] long}` padded columns (-1 where a pair lacks
            the name); read them with `position(name)`, which also knows `"END"`.
    """

    clean_ids: torch.Tensor
    corrupted_ids: torch.Tensor
    attention_mask: torch.Tensor
    answers: torch.Tensor
    answer_mask: torch.Tensor
    counterfactuals: torch.Tensor
    counterfactual_mask: torch.Tensor
    pairs: list[PromptPair | None] = field(default_factory=list)
    tokens: list[list[str]] = field(default_factory=list)
    positions: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """N, the number of pairs."""
        return int(self.clean_ids.shape[0])

    def __repr__(self) -> str:
        """`PairBatch(n=3, width=1024, answers=1, positions=['needle', 'end'])`: the shapes, not the
        tensors (a long prompt's ids printed whole filled a notebook cell)."""
        names = list(self.positions)
        return (
            f"PairBatch(n={self.n}, width={self.width}, answers={int(self.answers.shape[1])}, "
            f"positions={names})"
        )

    def __len__(self) -> int:
        return self.n

    @property
    def width(self) -> int:
        """T, the padded length."""
        return int(self.clean_ids.shape[1])

    @property
    def lengths(self) -> torch.Tensor:
        """`[N]` real token counts."""
        return self.attention_mask.sum(-1)

    @property
    def has_images(self) -> bool:
        """True for vision pairs (`heads.scorers.patching.vision.ImagePairBatch`)."""
        return False

    @property
    def has_counterfactual(self) -> bool:
        return bool(self.counterfactual_mask.any(-1).all())

    def ids(self, which: str) -> torch.Tensor:
        """`clean_ids` for `"clean"`, `corrupted_ids` for `"corrupted"`."""
        if which == "clean":
            return self.clean_ids
        if which == "corrupted":
            return self.corrupted_ids
        raise HeadsteerValueError(f"which must be 'clean' or 'corrupted', got {short_repr(which)}")

    def prompts(self, which: str = "clean") -> EncodedPrompts:
        """One side of the pairs as `EncodedPrompts` (the same left-padded ids and mask, no
        emphasized spans; texts from the source `PromptPair`s, `""` where built from ids), for
        the functions that take prompts: `heads.record`, `run_with_hooks`, `qk_attribution`
        (which take a `PairBatch` itself as its clean side).

        Raises:
            HeadsteerValueError: `which` not `"clean"` / `"corrupted"`.
        """
        ids = self.ids(which)
        texts = [("" if p is None else getattr(p, which)) for p in self.pairs] or [""] * self.n
        empty: list[list[tuple[int, int]]] = [[] for _ in range(self.n)]
        return EncodedPrompts(ids, self.attention_mask, empty, texts, [[] for _ in range(self.n)])

    @property
    def clean(self) -> EncodedPrompts:
        """The clean prompts as `EncodedPrompts` (`prompts("clean")`)."""
        return self.prompts("clean")

    @property
    def corrupted(self) -> EncodedPrompts:
        """The corrupted prompts as `EncodedPrompts` (`prompts("corrupted")`): pass
        `record(model, pairs.corrupted)` to record the corrupted side."""
        return self.prompts("corrupted")

    def select(self, index: Sequence[int] | torch.Tensor) -> PairBatch:
        """The pairs at `index`, re-trimmed to their own longest row."""
        idx = torch.as_tensor(index, dtype=torch.long)
        mask = self.attention_mask[idx]
        trim = int(self.width - mask.sum(-1).max()) if len(idx) else 0
        return PairBatch(
            self.clean_ids[idx, trim:],
            self.corrupted_ids[idx, trim:],
            mask[:, trim:],
            self.answers[idx],
            self.answer_mask[idx],
            self.counterfactuals[idx],
            self.counterfactual_mask[idx],
            [self.pairs[i] for i in idx.tolist()] if self.pairs else [],
            [self.tokens[i] for i in idx.tolist()] if self.tokens else [],
            {k: torch.where(v[idx] >= 0, v[idx] - trim, -1) for k, v in self.positions.items()},
        )

    @property
    def position_names(self) -> list[str]:
        """The named positions every pair has (`"END"` first, then the stored names in order)."""
        return ["END", *(k for k, v in self.positions.items() if bool((v >= 0).all()))]

    def position(self, name: str) -> torch.Tensor:
        """`[N]` long: the padded column of named position `name` in every pair; `"END"` is the
        last column (`T - 1`, the last real token under left padding).

        Raises:
            ValueError: a name the pairs do not carry (the message lists those they do), or
                one that some pairs lack (names the first of them).
        """
        if name == "END":
            return torch.full((self.n,), self.width - 1, dtype=torch.long)
        if not isinstance(name, str) or name not in self.positions:
            raise HeadsteerValueError(
                f"unknown position {short_repr(name)}: these pairs carry {', '.join(self.position_names)}"
            )
        pos = self.positions[name]
        if bool((pos < 0).any()):
            raise HeadsteerValueError(
                f"pair {int((pos < 0).nonzero()[0])} has no position {short_repr(name)}"
            )
        return pos.clone()

    def misaligned_names(self, columns: Sequence[int]) -> str | None:
        """None when each of `columns` (padded) holds the same named positions in every pair; else
        a note naming the first column that does not, e.g. `IO` in 4 pairs and `S1` in 4 (pairs of
        interleaved templates, such as IOI's ABBA / BABA, share their lengths but not their roles:
        a by-position mean then mixes the roles)."""
        for c in columns:
            names = [
                "+".join(k for k, v in self.positions.items() if int(v[i]) == c) or "no name"
                for i in range(self.n)
            ]
            if len(set(names)) > 1 and any(n != "no name" for n in names):
                counts = ", ".join(f"{n!r} in {names.count(n)}" for n in dict.fromkeys(names))
                return (
                    f"column {c} holds different named positions in different pairs ({counts} pairs), "
                    "so its mean mixes their roles; patch the pairs of one template per call "
                    "(pairs.select([...]))"
                )
        return None

    def position_labels(self, row: int = 0, tokenizer: Any = None) -> list[str]:
        """`T` labels of the padded columns for pair `row`: its clean tokens as readable text,
        `""` on padding (positions are aligned only across pairs of one template).

        Pairs built from token ids (`pairs_from_tokens` without `tokens=`) carry no text: their
        ids are decoded with `tokenizer` (the model's; `heads.inputs.tokens.readable_token`),
        and an id it does not know, or every id without a tokenizer, is labelled `"id 504"`
        (a bare `"504"` read as a number token).
        """
        n_pad = self.width - int(self.lengths[row])
        if self.tokens:
            toks = list(self.tokens[row])
        else:
            ids = self.clean_ids[row, n_pad:].tolist()
            toks = [token_label(tokenizer, i) for i in ids]
        return [""] * n_pad + toks

    @property
    def labels_from(self) -> str:
        """Where `position_labels` comes from, for a result's `params["labels_from"]`."""
        return "pair 0's clean tokens" if self.tokens else "pair 0's clean token ids"

    def split(self, frac: float = 0.5, seed: int = 0) -> tuple[PairBatch, PairBatch]:
        """A seeded random split of the pairs into two batches (`frac` of them first)."""
        g = torch.Generator().manual_seed(check_seed("seed", seed))
        perm = torch.randperm(self.n, generator=g)
        k = max(1, min(self.n - 1, round(self.n * frac)))
        return self.select(perm[:k].sort().values), self.select(perm[k:].sort().values)


def token_label(tokenizer: Any, token_id: int) -> str:
    """A position label for `token_id` when no text came with it: the token as readable text
    (`readable_token`) when `tokenizer` knows the id, else `"id <token_id>"`."""
    from heads.inputs.tokens import readable_token

    if tokenizer is not None and 0 <= token_id < len(tokenizer):
        return readable_token(tokenizer, token_id)
    return f"id {token_id}"


def _answer_list(value: Answer | None, where: str) -> list[str | int]:
    if value is None:
        return []
    if isinstance(value, (str, numbers.Integral)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        out = list(value)
        if not out:
            raise HeadsteerValueError(f"{where} is an empty list")
        return out
    raise HeadsteerTypeError(
        f"{where} must be a string, a token id or a list of them, got {short_repr(value)}"
    )
