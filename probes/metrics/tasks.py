"""Metrics and confidence intervals for the evaluation tasks in `probes.datasets.tasks`.

- `json_metrics`: JSON validity and field accuracy (json_format).
- `no_pronoun`: no gendered pronoun left in the output (pronoun_change).
- `choice_correct`: the labelled choice has the strictly highest log-probability (choice tasks;
  for counterfact this is new-fact efficacy, P(new) > P(old)).
- `wilson_interval` / `mean_interval`: 95% intervals for rates (Wilson) and for means
  (Student t), through scipy; `INTERVAL_METHODS` names them for tables.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from heads._util.validation import MAX_JSON_INT_DIGITS, check_number, short_repr
from heads.errors import HeadsteerValueError

__all__ = [
    "INTERVAL_METHODS",
    "choice_correct",
    "first_json_object",
    "json_metrics",
    "mean_interval",
    "no_pronoun",
    "wilson_interval",
]

INTERVAL_METHODS = {"rate": "Wilson 95%", "mean": "Student t 95%"}
"""The interval named in an evaluation table's `interval` column, by metric kind."""

_CURLY = str.maketrans({"\u201c": '"', "\u201d": '"', "\u201e": '"', "\u2018": "'", "\u2019": "'"})
_PRONOUN = re.compile(r"\b(?:she|he|her|his|him)\b", re.IGNORECASE)


def first_json_object(text: str) -> str | None:
    """The first balanced `{...}` substring of `text`, or None.

    Braces inside double-quoted strings (with backslash escapes) are not counted.
    """
    start = text.find("{")
    while start != -1:
        depth, in_string, escaped = 0, False, False
        for i in range(start, len(text)):
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start : i + 1]
        start = text.find("{", start + 1)  # unbalanced from here: try the next opening brace
    return None


def _int_or_text(digits: str) -> int | str:
    """A JSON integer as an `int`, or as its text past Python's 4300-digit `int(str)` limit
    (still valid JSON; compared as text by `json_metrics`, as every value is)."""
    return int(digits) if len(digits.lstrip("-")) <= MAX_JSON_INT_DIGITS else digits


def _parse(text: str) -> dict | None:
    candidate = first_json_object(text)
    if candidate is None:
        return None
    try:
        value = json.loads(candidate, parse_int=_int_or_text)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deeply to parse
        return None
    return value if isinstance(value, dict) else None


def json_metrics(text: str, fields: Mapping[str, str]) -> dict[str, float | bool]:
    """JSON validity and field accuracy of a generated answer.

    The first balanced `{...}` object of `text` is parsed with `json.loads`; if that fails, the
    same is tried once more after replacing curly quotes (“ ” ‘ ’) with straight ones, so typographic
    quotes do not make an otherwise valid object invalid.

    Returns:
        `{"json_valid": bool, "field_accuracy": float}`; field accuracy is the fraction of
        `fields` whose expected value occurs (case-insensitive, stripped) in the parsed value of
        the same key, and 0.0 when the text holds no valid object.
    """
    parsed = _parse(text)
    if parsed is None:
        parsed = _parse(text.translate(_CURLY))
    if parsed is None or not fields:
        return {"json_valid": parsed is not None, "field_accuracy": 0.0}
    hits = 0
    for key, expected in fields.items():
        value = parsed.get(key)
        if value is None:
            continue
        got = str(value).translate(_CURLY).strip().lower()
        hits += str(expected).translate(_CURLY).strip().lower() in got
    return {"json_valid": True, "field_accuracy": hits / len(fields)}


def no_pronoun(text: str) -> bool:
    """True when `text` holds no standalone she / he / her / his / him (any case).

    Word boundaries are used, so "Sheila", "then" or "hero" do not count.
    """
    return _PRONOUN.search(text) is None


def choice_correct(logprobs: Sequence[float] | np.ndarray, label: int) -> bool:
    """True when choice `label` has a strictly higher log-probability than every other choice.

    Ties count as wrong. Accepts a sequence, a NumPy array or a CPU tensor of shape (n_choices,).

    Raises:
        ValueError: fewer than two choices, a non-1-D input, or `label` out of range.
    """
    scores = np.asarray(logprobs, dtype=float)
    if scores.ndim != 1 or scores.size < 2:
        raise HeadsteerValueError(f"need a 1-D vector of >= 2 choice log-probs, got shape {scores.shape}")
    if not 0 <= label < scores.size:
        raise HeadsteerValueError(f"label {short_repr(label)} out of range for {scores.size} choices")
    others = np.delete(scores, label)
    return bool(np.all(scores[label] > others))


def _confidence(confidence: object) -> float:
    return check_number("confidence", confidence, lo=0, hi=1, lo_open=True, hi_open=True)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a success rate (Wilson 1927), default 95%.

    z is the two-sided normal quantile of `confidence` (`scipy.stats.norm.ppf`; 1.95996 at
    95%). Unlike the normal (Wald) interval it stays inside [0, 1] and is not empty at 0 or n
    successes.

    Raises:
        ValueError: `n` < 1, `successes` outside [0, n], or `confidence` outside (0, 1).
    """
    from scipy.stats import norm

    if n < 1:
        raise HeadsteerValueError(f"wilson_interval needs n >= 1, got {n}")
    if not 0 <= successes <= n:
        raise HeadsteerValueError(f"successes must be in [0, {n}], got {successes}")
    z = float(norm.ppf(0.5 + _confidence(confidence) / 2))
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def mean_interval(values: Sequence[float] | np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """Student-t interval for the mean of `values`, default 95%: mean ± t * sd / sqrt(n).

    t is the two-sided quantile of Student's t with n - 1 degrees of freedom
    (`scipy.stats.t.ppf`; 2.131 at n = 16, 1.990 at n = 80, where the normal z = 1.960
    under-covers), sd the sample standard deviation (ddof=1).

    Raises:
        ValueError: fewer than two values, a non-finite value, or `confidence` outside (0, 1).
    """
    from scipy.stats import t as student_t

    conf = _confidence(confidence)
    x = np.asarray(values, dtype=float).ravel()
    if x.size < 2:
        raise HeadsteerValueError(f"mean_interval needs at least 2 values, got {x.size}")
    if not np.all(np.isfinite(x)):
        raise HeadsteerValueError("mean_interval got a non-finite value")
    mean = float(x.mean())
    half = float(student_t.ppf(0.5 + conf / 2, df=x.size - 1)) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean - half, mean + half
