"""`headsteer report safety`: Ships, dataset-level Ships, Sahara and the ASR they explain.

The numbers come from `probes.studies.safety.safety_analysis` (a `SafetyAnalysis`); this module only
draws them (`render_safety_report`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from heads import HeadModel
from heads._util.files import check_output
from heads._util.progress import ProgressArg
from heads._util.validation import check_forwarded, read_jsonl_file
from heads.errors import HeadsteerValueError
from probes.studies.safety import SafetyAnalysis, safety_analysis, safety_template
from viz.figures import head_heatmap
from viz.reports.base import Report

__all__ = ["MAX_PROMPTS", "read_prompts", "render_safety_report", "safety_report", "safety_template"]

MAX_PROMPTS = 10_000
"""Cap on the prompts `read_prompts` accepts from one file (each is generated 5+ times)."""


def read_prompts(path: str | Path, limit: int | None = MAX_PROMPTS) -> list[str]:
    """Prompts from a JSONL file (`{"prompt": ...}` per line) or a text file (one per line).

    The file is read line by line (never whole); blank lines are skipped.

    Raises:
        ValueError: no prompts, a JSONL line that is not JSON or holds an integer of more than
            4300 digits (one line naming the file and line), a JSONL line without a string
            "prompt", a line that is not UTF-8 text, or more than `limit` prompts (default
            `MAX_PROMPTS`; None: no cap).
        FileNotFoundError: no such file.
    """
    out = []
    if str(path).endswith(".jsonl"):
        for n, row in read_jsonl_file(path):  # one line: not JSON (column), a number too large
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise HeadsteerValueError(f"{str(path)!r} line {n} has no string 'prompt'")
            out.append(row["prompt"])
            if limit is not None and len(out) > limit:
                raise HeadsteerValueError(f"{str(path)!r} holds more than the cap of {limit} prompts")
    else:
        with open(path, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise HeadsteerValueError(f"{str(path)!r} line {n} is not valid UTF-8 text") from None
                if not line.strip():
                    continue
                out.append(line.strip())
                if limit is not None and len(out) > limit:
                    raise HeadsteerValueError(f"{str(path)!r} holds more than the cap of {limit} prompts")
    if not out:
        raise HeadsteerValueError(f"no prompts in {str(path)!r}")
    return out


def render_safety_report(result: SafetyAnalysis) -> Report:
    """The safety-head report of a computed `SafetyAnalysis` (nothing is recomputed).

    Sections: the baseline refusal rate, ASR with heads ablated, Ships and dataset-level
    Ships heatmaps, Sahara's chosen heads, and the first three answers side by side.
    """
    asr, asr_keyword, n_eval = result.asr, result.asr_keyword, len(result.eval_prompts)
    n_score = len(result.score_prompts)
    rep = Report(
        f"Safety heads: Ships, dataset-level Ships and Sahara on {n_score} harmful requests, "
        f"attack success rate on {n_eval}",
        result.model,
        dict(result.params),
    )
    rep.text(
        "Baseline refusal rate",
        f"{1 - asr['baseline']:.2f} of {n_eval} harmful requests refused with no head ablated "
        '(explicit refusal openers such as "I\'m sorry" or "I cannot"). The paper\'s full keyword judge '
        f"(41 phrases incl. hedges, < 32 tokens, repetition) counts "
        f"{1 - asr_keyword['baseline']:.2f} as refused.",
    )
    rep.table(
        "ASR with heads ablated (UA, exact)",
        result.asr_table,
        note="Attack success rate (share of harmful requests answered without a refusal) with no head, "
        "Sahara's first head, its first three heads, and three random heads ablated: safety heads "
        "raise it more than random heads do.",
    )
    rep.figure(
        "Ships (mean KL over prompts, nats)",
        head_heatmap(
            result.ships.scores,
            top_k=10,
            title=f"Ships: KL of the next-token distribution, head ablated — {result.model}",
        ),
        note=f"How much ablating each head alone changes the next-token distribution on the {n_score} "
        "scoring requests (KL divergence in nats, mean over requests); red boxes mark the top 10.",
    )
    rep.figure(
        "Dataset-level Ships (principal angle, degrees)",
        head_heatmap(
            result.dataset_ships,
            top_k=10,
            title=f"Dataset-level Ships: principal angle, head ablated — {result.model}",
        ),
        note="How far ablating each head alone turns the main direction of the final states over all "
        "scoring requests (principal angle in degrees); red boxes mark the top 10.",
    )
    rep.table(
        "Sahara: chosen head per step",
        result.sahara_table,
        note="Sahara's greedy search: at each step the head whose ablation, together with the heads "
        "already chosen, turns the final states furthest from the unablated model's.",
    )
    texts, base, top3 = result.texts, result.answers["baseline"], result.answers["sahara_top3"]
    for i in range(min(3, n_eval)):
        rep.samples(
            f"Sample {i + 1}",
            texts[i],
            {"baseline": base[i], "Sahara top-3 ablated": top3[i]},
            note="The model's greedy answer to this request, unablated and with Sahara's first three "
            "heads ablated.",
        )
    rep.seconds = result.seconds
    return rep


def safety_report(
    model: HeadModel,
    out: str | Path,
    *,
    overwrite: bool = False,
    progress: ProgressArg = True,
    **analysis: Any,
) -> tuple[Path, dict]:
    """Compute the safety-head analysis (`probes.studies.safety.safety_analysis`), write its
    report to `out` (HTML, checked before any work; an existing file only with `overwrite=True`)
    and return the path with a JSON-able summary (`SafetyAnalysis.summary()`).

    Args:
        analysis: the keyword arguments of `safety_analysis`, passed on: `prompts`, `steps` (3),
            `system_prompt`, `n_score` (16), `max_new_tokens` (48), `random_draws` (3), `seed`
            (0), `batch_size` (16), `executor` ("local", "ray" or a
            `heads.engine.executors.Executor`: runs the Ships sweeps in shards, see
            `heads.scorers.safety.ships.ships`).
        progress: as `safety_analysis` (default True: a bar).

    Raises:
        HeadsteerTypeError: a keyword `safety_analysis` does not take.
        ValueError: `out` exists and `overwrite` is False, or is a symlink; and as
            `safety_analysis`.
    """
    check_forwarded("safety_report", analysis, safety_analysis)
    check_output(out, overwrite)
    result = safety_analysis(model, progress=progress, **analysis)
    path = render_safety_report(result).save(out, overwrite=overwrite)
    return path, result.summary()
