"""`headsteer report qk`: why one head attends where it does, on induction, IOI or your prompts.

The page for head (layer, head): the terms of its logit at a focus cell (ranked pairs and a
component x component map), each key's key-side and query-side marginals for the query, the
upstream heads and source tokens behind the key and the query (`by="source_token"`), the mean
marginals at the focus cells over the prompts, and the weight-based Q- / K-composition into the
head. The focus cell per task:

* `induction`: rows `[BOS] + R + R` of random tokens; the query is a token of the second copy,
  the focus key the token after its first occurrence (Olsson et al. 2022);
* `ioi`: the shipped IOI prompts (clean); the query is the last token (END), the focus key the
  indirect object's name (Wang et al. 2023);
* a file: text prompts (one per line, or JSONL with a `"prompt"` / `"text"` field); the query is
  the last token, the focus key the one the head attends to most.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pandas as pd
import torch

from heads import HeadModel
from heads._util.files import check_output, is_file
from heads._util.progress import ProgressArg, progress_callback
from heads._util.validation import check_int
from heads.errors import HeadsteerValueError
from heads.inputs.prompts import EncodedPrompts
from heads.results.qk import QKAttribution
from heads.scorers.qk.request import CompositionRequest, QKRequest
from viz.qk import (
    SIGN_NOTE,
    composition_heatmap,
    qk_key_map,
    qk_pair_bars,
    qk_pair_heatmap,
    qk_sources_heatmap,
)
from viz.reports.base import Report

__all__ = ["MAX_PROMPTS", "TASKS", "QKTask", "qk_report", "qk_steps", "qk_task", "read_prompt_file"]

TASKS = ("induction", "ioi")
"""Tasks `--task` accepts by name (any other value is a prompt file)."""

MAX_PROMPTS = 64


@dataclass
class QKTask:
    """Prompts and the focus cell of each: `query` / `key` token positions per prompt (`key`
    None: the most-attended key)."""

    name: str
    prompts: EncodedPrompts | list[str]
    query: list[int]
    key: list[int | None]
    note: str


def read_prompt_file(path: str | os.PathLike) -> list[str]:
    """Text prompts from a file: JSONL objects with `"prompt"` or `"text"`, else one per line
    (blank lines skipped).

    Raises:
        ValueError: no such file, no prompt in it, a JSONL line without either field.
    """
    if not is_file(path):
        raise HeadsteerValueError(f"prompt file {str(path)!r} does not exist")
    from heads._util.validation import read_text_file

    lines = [ln for ln in read_text_file(path).splitlines() if ln.strip()]  # not UTF-8: one line
    if not lines:
        raise HeadsteerValueError(f"prompt file {str(path)!r} holds no prompt")
    out = []
    for i, ln in enumerate(lines, 1):
        if ln.lstrip().startswith("{"):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise HeadsteerValueError(f"{str(path)!r} line {i}: not JSON ({e.msg})") from None
            text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise HeadsteerValueError(f"{str(path)!r} line {i}: no 'prompt' or 'text' string")
            out.append(text)
        else:
            out.append(ln)
    return out


def _first(ids: list[int], target: list[int]) -> int | None:
    n = len(target)
    for i in range(len(ids) - n + 1):
        if ids[i : i + n] == target:
            return i
    return None


def _pack(rows: list[list[int]]) -> EncodedPrompts:
    """Token rows, left-padded (pad id 0 under the mask), as `EncodedPrompts`."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r)
        mask[b, width - len(r) :] = 1
    n = len(rows)
    return EncodedPrompts(ids, mask, [[] for _ in range(n)], ["" for _ in range(n)], [[] for _ in range(n)])


def qk_task(model: HeadModel, task: str | os.PathLike, n_prompts: int = 4, *, seed: int = 0) -> QKTask:
    """The prompts and focus cells of `task` (`"induction"`, `"ioi"` or a prompt file).

    `n_prompts` rows (1..64, default 4); from a prompt file, at most: its first `n_prompts`
    prompts (every prompt of a shorter file; the task's note and `len(task.query)` give the count).

    Raises:
        ValueError: an unknown task that is not a file, a bad file, `n_prompts` not in 1..64, IOI
            on a model without a tokenizer.
    """
    check_int("n_prompts", n_prompts, lo=1, hi=MAX_PROMPTS)
    if task == "induction":
        from heads.scorers.roles.detectors import _bos_id, repeated_tokens

        n = 20
        enc = repeated_tokens(model, n_seqs=n_prompts, length=(n, n), seed=seed)
        b = 1 if _bos_id(model) is not None else 0
        i = n // 2
        q, k = b + n + i, b + i + 1
        note = (
            f"{n_prompts} rows of [BOS] + R + R, R {n} random tokens; query = position {q} (token R[{i}] "
            f"of the second copy), focus key = position {k} (R[{i + 1}], the token after R[{i}]'s first "
            "occurrence: where an induction head attends)."
        )
        return QKTask("induction", enc, [q] * n_prompts, [k] * n_prompts, note)
    if task == "ioi":
        from probes.datasets.pairs import load_task_pairs

        tok = model.tokenizer
        if tok is None:
            raise HeadsteerValueError("the IOI task needs a model with a tokenizer")
        pairs = load_task_pairs("ioi", n=n_prompts)
        rows: list[list[int]] = []
        keys: list[int | None] = []
        queries: list[int] = []
        for p in pairs:
            ids = tok(p.clean, add_special_tokens=False)["input_ids"]
            io = _first(ids, tok(p.answer, add_special_tokens=False)["input_ids"])
            if io is None:
                raise HeadsteerValueError(
                    f"IOI prompt {p.clean!r}: the indirect object is not among its tokens"
                )
            rows.append(ids)
            queries.append(len(ids) - 1)
            keys.append(io)
        note = (
            f"{len(rows)} IOI prompts (shipped, clean); query = the last token (END), focus key = the "
            "indirect object's name (its first token), where name movers attend."
        )
        return QKTask("ioi", _pack(rows), queries, keys, note)
    prompts = read_prompt_file(task)[:n_prompts]
    note = (
        f"{len(prompts)} prompts from {Path(str(task)).name}; query = the last token, focus key = the "
        "most-attended."
    )
    return QKTask(Path(str(task)).name, prompts, [-1] * len(prompts), [None] * len(prompts), note)


def qk_steps() -> int:
    """Progress units of `qk_report`: attribution, composition, page."""
    return 3


def _focus(r: QKAttribution, task: QKTask) -> list[tuple[int, int]]:
    """Per prompt, the (query index, key index) of its focus cell."""
    out = []
    for n in range(r.n_prompts):
        k = task.key[n]
        if k is None:
            row = torch.where(r.valid[n, 0], r.pattern[n, 0].nan_to_num(-1.0), -1.0)
            ki = int(row.argmax())
        else:
            ki = r.keys[n].tolist().index(k)
        out.append((0, ki))
    return out


def _focus_table(r: QKAttribution, cells: list[tuple[int, int]], top: int = 15) -> pd.DataFrame:
    q = torch.stack([r.query_marginals()[n, qi, ki] for n, (qi, ki) in enumerate(cells)]).mean(0)
    k = torch.stack([r.key_marginals()[n, qi, ki] for n, (qi, ki) in enumerate(cells)]).mean(0)
    rows = []
    for side, m in (("query", q), ("key", k)):
        for c in m.abs().argsort(descending=True)[:top].tolist():
            rows.append({"side": side, "component": r.names[c], "mean marginal (logit)": float(m[c])})
    return pd.DataFrame(rows)


def qk_report(
    model: HeadModel,
    out: str | Path,
    *,
    head: tuple[int, int] | str,
    task: str | os.PathLike = "induction",
    n_prompts: int = 4,
    overwrite: bool = False,
    attribution_json: str | Path | None = None,
    progress: ProgressArg = True,
    request: QKRequest | None = None,
) -> tuple[QKAttribution, dict]:
    """QK attribution of `head` on `task` (module docstring), written to `out`.

    The analyses run as requests through `heads.run`: `request` (default: `QKRequest(head=head,
    by="source_token")`; the CLI's, checked against the config before the model loaded) with the
    task's query position, then `CompositionRequest(readers=[head])` for the composition into it.

    Returns:
        `(attribution, summary)`; summary: head, task, max_error, mean logit and attention at the
        focus cells, the top key- and query-side components there, the top K-composition writers.

    Raises:
        ValueError: `out` (or `attribution_json`) exists without `overwrite`, an unknown head, a
            refused family, a bad task or file, a focus key not found — all before any forward.
    """
    check_output(out, overwrite)
    if attribution_json is not None:
        check_output(attribution_json, overwrite)
    if request is None:
        request = QKRequest(head=head, by="source_token")
    request.check_config(model)  # the family and the head, before any forward
    layer, h = cast("tuple[int, int]", request.head)
    t = qk_task(model, task, n_prompts)
    from heads import run

    with progress_callback(progress, "qk report", "steps") as report:
        tick = (lambda i: report(i, qk_steps())) if report is not None else (lambda i: None)
        tick(0)
        query = t.query[0] if t.name == "induction" else -1  # else each prompt's last token
        r = run(model, request.replace(query=query), t.prompts)
        tick(1)
        cs = run(model, CompositionRequest(readers=[(layer, h)])) if layer > 0 else None
        tick(2)
        cells = _focus(r, t)
        qi0, ki0 = cells[0]
        q0, k0 = int(r.queries[0, qi0]), int(r.keys[0, ki0])
        logit = [float(r.logits[n, qi, ki]) for n, (qi, ki) in enumerate(cells)]
        attn = [float(r.pattern[n, qi, ki]) for n, (qi, ki) in enumerate(cells)]
        table = _focus_table(r, cells)
        rep = Report(
            f"QK attribution of L{layer}H{h} on {t.name}",
            model.name,
            {"head": f"{layer}.{h}", "task": str(task), "prompts": r.n_prompts},
        )
        rep.text(
            "What this shows",
            f"{t.note} Each logit is an exact sum of query-component x key-component terms with every "
            "norm's scale frozen at its value in the run (largest |sum - model logit| = "
            f"{r.max_error():.2g}). "
            f"Mean logit at the focus cells {sum(logit) / len(logit):.3f}, mean attention there "
            f"{sum(attn) / len(attn):.3f}.",
        )
        rep.figure(
            "Which components make each key win (prompt 0)",
            qk_key_map(r, "key", 0, q0),
            note=f"Key-side marginals q(query) . b_j(key) x scale per key; {SIGN_NOTE}.",
        )
        rep.figure("Top terms at the focus cell (prompt 0)", qk_pair_bars(r, 0, q0, k0), note=SIGN_NOTE)
        rep.figure(
            "Query side x key side at the focus cell (prompt 0)",
            qk_pair_heatmap(r, 0, q0, k0),
            note=f"The components with the largest marginals on each side; {SIGN_NOTE}.",
        )
        for side in ("key", "query"):
            rep.figure(
                f"Through source tokens: the {side} side (prompt 0)",
                qk_sources_heatmap(r, side, 0, q0, k0),
                note=f"Each upstream head's {side}-side marginal split over the positions it read "
                f"(its pattern frozen); {SIGN_NOTE}.",
            )
        rep.table(
            "Mean marginals at the focus cells, over the prompts",
            table,
            max_rows=30,
            note="The largest query-side and key-side components (logit units).",
        )
        top_k: list = []
        if cs is not None:
            rep.figure(
                "K-composition into this head (weights)",
                composition_heatmap(cs, "k", reader=(layer, h)),
                note=f"Elhage et al.'s K-composition minus the random baseline ({cs.baseline:.3f}); "
                "RoPE ignored.",
            )
            rep.figure(
                "Q-composition into this head (weights)",
                composition_heatmap(cs, "q", reader=(layer, h)),
                note="As above, into the query.",
            )
            top_k = [
                (f"L{a}H{b}", round(float(cs.k[a, b, layer, h]), 4))
                for a, b in cs.head_scores("k", reader=(layer, h)).ranked(5)
            ]
        rep.save(out, overwrite=overwrite)
        if attribution_json is not None:
            r.save(attribution_json, overwrite=overwrite)
        tick(3)
    summary = {
        "head": f"L{layer}H{h}",
        "task": t.name,
        "prompts": r.n_prompts,
        "max_error": r.max_error(),
        "focus_logit": sum(logit) / len(logit),
        "focus_attention": sum(attn) / len(attn),
        "top_key_side": table[table.side == "key"].head(5).values[:, 1:].tolist(),
        "top_query_side": table[table.side == "query"].head(5).values[:, 1:].tolist(),
        "top_k_composition": top_k,
    }
    return r, summary
