"""Mechanisms across training: the organism's training time, the cost of an analysis per checkpoint
against one analysis on one model, and the induction phase change's steps.

1. Train the attention-only organism (`probes.organism.recipe.ATTN_ONLY`, or `--steps`) into a
   temporary folder: `train_s` (seconds, one torch thread, as the recipe fixes).
2. Baseline: the `"induction_phase"` analysis run by hand on `--single` checkpoints (load the
   folder with `load_model`, run the analysis): the mean seconds of one.
3. `over_checkpoints` on every checkpoint of the run: seconds per checkpoint, and
   `per_checkpoint_over_single` = that / the baseline (goal <= 1.1: nothing is wasted between
   checkpoints).
4. `phase_change` on that series: the jump step (midpoint rule) of the ICL score, the best
   layer-1 induction head, the best layer-0 previous-token head, the loss on repeated rows and the
   K-composition, with their windows.

Prints one JSON line (and the load average, since the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from heads import load_model  # noqa: E402
from heads.dynamics import Analysis, over_checkpoints  # noqa: E402
from heads.dynamics.phase import phase_change  # noqa: E402
from probes.organism.recipe import ATTN_ONLY, train_organism  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=ATTN_ONLY.steps)
    ap.add_argument("--single", type=int, default=3, help="checkpoints analysed by hand for the baseline")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run in this (new) folder")
    args = ap.parse_args()
    load = os.getloadavg()
    spec = replace(ATTN_ONLY, steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="organism-") as tmp:
        run = args.keep or Path(tmp) / "run"
        log = train_organism(spec, run)
        folders = sorted(run.glob("step-*"))
        job = Analysis.of("induction_phase", {"n": 16})
        picks = [folders[len(folders) * (i + 1) // (args.single + 1)] for i in range(args.single)]
        t0 = time.perf_counter()
        for f in picks:
            job.run(load_model(f))
        single = (time.perf_counter() - t0) / len(picks)
        t0 = time.perf_counter()
        series = over_checkpoints(folders, job, progress=False)
        per = (time.perf_counter() - t0) / len(folders)
        phase = phase_change(series)
    out = {
        "train_s": round(log["seconds"], 1),
        "steps": spec.steps,
        "checkpoints": len(folders),
        "per_checkpoint_s": round(per, 3),
        "single_s": round(single, 3),
        "per_checkpoint_over_single": round(per / single, 3),
        "icl_jump_step": phase.jumps["icl"].step,
        "induction_jump_step": phase.jumps["induction"].step,
        "prev_token_jump_step": phase.jumps["previous_token"].step,
        "loss_jump_step": phase.jumps["loss"].step if "loss" in phase.jumps else None,
        "k_composition_jump_step": phase.jumps["k_composition"].step
        if "k_composition" in phase.jumps
        else None,
        "windows": {k: list(e.window) for k, e in phase.jumps.items()},
        "values": {
            k: [round(v["first"], 3), round(v["last"], 3)]
            for k, v in phase.summary().items()
            if isinstance(v, dict) and "first" in v
        },
        "spread": phase.summary()["spread"],
        "heads": phase.summary()["heads"],
        "final_loss": round(log["losses"][-1], 3),
        "load_avg": [round(x, 2) for x in load],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
