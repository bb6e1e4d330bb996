"""AdaptVis / ScalingVis, text-context variant, on the embedded model: `context_qa` accuracy.

`context_qa` (shipped task): a passage contradicting a well-known fact, then a question; the
answer is scored by the log-probability of the choices at the last prompt token, which is exactly
the row AdaptVis edits. The passage is the emphasized span (`target="text"`). Rows: no steering,
ScalingVis at alpha 0.5 / 1.5 / 3.0, AdaptVis with the reference's example defaults (0.5 / 1.5,
threshold 0.4). Wilson 95 % intervals, the paired changes against no steering, and the confidence
split (how many rows AdaptVis sent to weight1). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from heads import load_model  # noqa: E402
from probes.datasets.tasks import load_task  # noqa: E402
from probes.metrics.tasks import wilson_interval  # noqa: E402
from probes.studies.evaluate import _choice_rows  # noqa: E402
from steer.adaptvis import AdaptVis, ScalingVis  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    hm = load_model()
    examples = load_task("context_qa", "test").examples[: args.limit]
    adapt = AdaptVis(target="text")
    low_rows = []

    class Counted:  # AdaptVis, counting the rows sent to weight1 over all batches
        def edits(self, model, enc):
            out = adapt.edits(model, enc)
            low_rows.append(int((adapt.last["weight"] < 1).sum()))
            return out

    methods = {
        "none": [],
        "scalingvis_0.5": [ScalingVis(0.5, target="text")],
        "scalingvis_1.5": [ScalingVis(1.5, target="text")],
        "scalingvis_3.0": [ScalingVis(3.0, target="text")],
        "adaptvis": [Counted()],
    }
    rows = {m: _choice_rows(hm, examples, s, args.batch_size, lambda n: None) for m, s in methods.items()}
    base = [r["correct"] for r in rows["none"]]
    out = {"bench": "adaptvis_text", "model": hm.name, "task": "context_qa", "n": len(base)}
    for m, rs in rows.items():
        ok = [r["correct"] for r in rs]
        lo, hi = wilson_interval(sum(ok), len(ok))
        out[m] = {
            "context_accuracy": round(sum(ok) / len(ok), 4),
            "interval": [round(lo, 3), round(hi, 3)],
            "fixed": sum(bool(o) and not b for b, o in zip(base, ok, strict=True)),
            "broken": sum(bool(b) and not o for b, o in zip(base, ok, strict=True)),
        }
    out["adaptvis_weight1_rows"] = sum(low_rows)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
