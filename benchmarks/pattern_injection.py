"""Pattern injection on the embedded model: induction accuracy with the discovered previous-token
heads' pattern injected (probes.studies.pattern_injection). Prints one JSON line.

    python benchmarks/pattern_injection.py [--n-seqs 64] [--pattern previous-token]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from heads import load_model  # noqa: E402
from probes.studies.pattern_injection import injection_effect  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-seqs", type=int, default=64)
    ap.add_argument("--discover-seqs", type=int, default=8)
    ap.add_argument("--pattern", default="previous-token")
    ap.add_argument("--weights", default="0.25,0.5,1.0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    hm = load_model()
    t0 = time.perf_counter()
    res = injection_effect(
        hm,
        pattern=args.pattern,
        weights=[float(w) for w in args.weights.split(",")],
        n_seqs=args.n_seqs,
        discover_seqs=args.discover_seqs,
        seed=args.seed,
    )
    out = {
        "bench": "pattern_injection",
        "model": hm.name,
        **res,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
