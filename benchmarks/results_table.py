"""Assemble the `headsteer eval` CSVs in a folder into the README's Markdown Results tables.

1. Every method on every task (the runs without `--prompt`): value [95% interval], as
   `headsteer eval` writes them (Wilson for rates, Student t for means).
2. Prompting baselines: per task, metric and method, none / prompt / method / prompt + method
   with 95% percentile bootstrap intervals over the examples, and the paired difference of the
   method (and of prompt + method) to the prompt (`probes.studies.baselines.baseline_table`,
   from the `.examples.csv` files). A difference whose interval is not above 0 is marked: the
   method does not beat the prompt there.

Usage: python benchmarks/results_table.py [FOLDER=results]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from probes.studies.baselines import baseline_table

ORDER = [
    "none",
    "pasta",
    "spotlight",
    "instaboost",
    "act",
    "caa",
    "var",
    "vhr",
    "adaptvis",
    "scalingvis",
    "iti",
]


def _runs(folder: str) -> dict[tuple[str, str, bool], Path]:
    """(task, method, prompt) -> the summary CSV of that run (test split)."""
    out = {}
    for f in sorted(Path(folder).glob("*.csv")):
        if f.name.endswith(".examples.csv") or ".baselines." in f.name:
            continue
        t = pd.read_csv(f)
        if t.empty or (t.split.iloc[0] if "split" in t else "test") != "test":
            continue
        prompt = bool(t.prompt.iloc[0]) if "prompt" in t else False
        out[(t.task.iloc[0], t.method.iloc[0], prompt)] = f
    return out


def method_table(runs: dict[tuple[str, str, bool], Path]) -> list[str]:
    frames = [pd.read_csv(f) for (_, _, p), f in runs.items() if not p]
    if not frames:
        return []
    df = pd.concat(frames)
    df["cell"] = df.apply(lambda r: f"{r.value:.2f} [{r.low:.2f}, {r.high:.2f}]", axis=1)
    wide = df.pivot_table(index=["task", "metric", "n"], columns="method", values="cell", aggfunc="first")
    cols = [m for m in ORDER if m in wide.columns]
    lines = ["| task | metric | n | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for (task, metric, n), row in wide.iterrows():
        cells = [row.get(m) if isinstance(row.get(m), str) else "n/a" for m in cols]
        lines.append(f"| {task} | {metric} | {n} | " + " | ".join(cells) + " |")
    return lines


def baselines(runs: dict[tuple[str, str, bool], Path]) -> pd.DataFrame:
    """Every (task, method) with all four runs: `baseline_table` rows."""
    tables = []
    for (task, method, prompt), f in runs.items():
        need = [(task, "none", False), (task, "none", True), (task, method, True)]
        if method == "none" or prompt or not all(k in runs for k in need):
            continue
        files = {
            "none": runs[(task, "none", False)],
            "prompt": runs[(task, "none", True)],
            "method": f,
            "prompt + method": runs[(task, method, True)],
        }
        ex = {c: pd.read_csv(p.with_suffix(".examples.csv")) for c, p in files.items()}
        n = min(len(e) for e in ex.values())  # runs of different --limit: their common first n
        tables.append(
            baseline_table(task, method, {c: e.iloc[:n].reset_index(drop=True) for c, e in ex.items()})
        )
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()


def baseline_lines(table: pd.DataFrame) -> list[str]:
    if table.empty:
        return []

    def cell(r) -> str:
        return f"{r.value:.2f} [{r.low:.2f}, {r.high:.2f}]"

    def diff(r) -> str:
        mark = "" if r.beats_prompt else " ✗"
        return f"{r.diff:+.2f} [{r.diff_low:+.2f}, {r.diff_high:+.2f}]{mark}"

    lines = [
        "| task | metric | n | method | none | prompt | method | prompt + method | method - prompt | "
        "prompt + method - prompt |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    order = {m: i for i, m in enumerate(ORDER)}
    for (task, metric, method), g in sorted(
        table.groupby(["task", "metric", "method"]),
        key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 99)),
    ):
        r = {row.condition: row for row in g.itertuples()}
        lines.append(
            f"| {task} | {metric} | {r['none'].n} | {method} | {cell(r['none'])} | {cell(r['prompt'])} | "
            f"{cell(r['method'])} | {cell(r['prompt + method'])} | {diff(r['method'])} | "
            f"{diff(r['prompt + method'])} |"
        )
        if not r["method"].beats_prompt:
            notes.append(
                f"{task} {metric}: {method} does not beat the prompt ({diff(r['method']).rstrip(' ✗')})"
            )
    return [*lines, "", *(f"- {n}" for n in notes)]


def main(folder: str = "results") -> None:
    runs = _runs(folder)
    if not runs:
        raise SystemExit(f"no eval CSVs in {folder}")
    print("\n".join(method_table(runs)))
    lines = baseline_lines(baselines(runs))
    if lines:
        print("\nPrompting baselines (bootstrap 95%; ✗: the interval is not above 0)\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:])
