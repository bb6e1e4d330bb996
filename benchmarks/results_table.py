"""Assemble the `headsteer eval` CSVs in a folder into the README's Markdown Results table."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ORDER = ["none", "pasta", "spotlight", "instaboost", "act", "caa", "var", "vhr", "adaptvis", "scalingvis"]


def main(folder: str = "results") -> None:
    files = sorted(Path(folder).glob("*.csv"))
    tables = [pd.read_csv(f) for f in files if not f.name.endswith(".examples.csv")]
    if not tables:
        raise SystemExit(f"no eval CSVs in {folder}")
    df = pd.concat(tables)
    df["cell"] = df.apply(lambda r: f"{r.value:.2f} [{r.low:.2f}, {r.high:.2f}]", axis=1)
    wide = df.pivot_table(index=["task", "metric", "n"], columns="method", values="cell", aggfunc="first")
    cols = [m for m in ORDER if m in wide.columns]
    print("| task | metric | n | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for (task, metric, n), row in wide.iterrows():
        cells = [row.get(m) if isinstance(row.get(m), str) else "n/a" for m in cols]
        print(f"| {task} | {metric} | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:])
