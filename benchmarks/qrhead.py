"""QRHead study: recall@1 / @3 of the QRHead retriever against BM25 and random heads.

Embedded SmolLM2-135M-Instruct (30 x 9 heads), the shipped set `probes/data/retrieval/qrhead.jsonl`
(a question, 10 passages, one relevant; `train` rows detect the heads, `test` rows are ranked).
Rankers on the test rows:

- `qrhead`: the `--k` heads with the best QR score on the train rows (`heads.scorers.retrieval`);
- `all_heads`: every head summed (the reference's full-head retriever);
- `random`: `--k` random heads, mean over `--random-sets` seeded sets;
- `bm25`: Okapi BM25 (`rank-bm25`, k1 = 1.5, b = 0.75) over each row's 10 passages, lower-cased words;
- `chance`: k / 10.

Each row's two prefills (query and null query) are computed once and reused by every head set.
Prints one JSON line. Run: `nice -n 10 python benchmarks/qrhead.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from heads import SweepOptions, load_model  # noqa: E402
from heads.scorers.retrieval.qrhead import qr_retrieve, qr_tokens, qrhead_scores, recall_at  # noqa: E402
from probes.datasets.make_retrieval import load_retrieval  # noqa: E402


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _recalls(score_lists: list[torch.Tensor], golds: list[int]) -> dict:
    n = len(golds)
    return {
        f"recall@{k}": round(sum(recall_at(s, g, k) for s, g in zip(score_lists, golds, strict=True)) / n, 4)
        for k in (1, 3)
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", type=int, default=40, help="train rows used (at most 40)")
    ap.add_argument("--test", type=int, default=40, help="test rows used (at most 40)")
    ap.add_argument("--k", type=int, default=16, help="retrieval heads (the reference's default 16)")
    ap.add_argument("--random-sets", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from rank_bm25 import BM25Okapi

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    hm = load_model()
    train, test = load_retrieval("train")[: args.train], load_retrieval("test")[: args.test]
    t0 = time.perf_counter()
    tok_train = [qr_tokens(hm, r["question"], r["passages"]) for r in train]
    tok_test = [qr_tokens(hm, r["question"], r["passages"]) for r in test]
    seconds = time.perf_counter() - t0
    hs = qrhead_scores(hm, train, tokens=tok_train, options=SweepOptions(progress=False))
    top = hs.ranked(args.k)
    golds = [r["gold"] for r in test]

    def run(heads) -> list[torch.Tensor]:
        return [qr_retrieve(hm, "", [], heads, tokens=t) for t in tok_test]

    res = {"qrhead": _recalls(run(top), golds), "all_heads": _recalls(run(None), golds)}
    gen = torch.Generator().manual_seed(args.seed)
    n_all = hm.n_layers * hm.n_heads
    rand = {"recall@1": 0.0, "recall@3": 0.0}
    for _ in range(args.random_sets):
        pick = torch.randperm(n_all, generator=gen)[: args.k].tolist()
        r = _recalls(run([divmod(i, hm.n_heads) for i in pick]), golds)
        for key in rand:
            rand[key] += r[key] / args.random_sets
    res["random"] = {k: round(v, 4) for k, v in rand.items()}
    bm = []
    for r in test:
        bm25 = BM25Okapi([_words(p) for p in r["passages"]])
        bm.append(torch.tensor(bm25.get_scores(_words(r["question"]))))
    res["bm25"] = _recalls(bm, golds)
    res["chance"] = {"recall@1": 0.1, "recall@3": 0.3}
    line = {
        "bench": "qrhead",
        "model": hm.name,
        "n_train": len(train),
        "n_test": len(test),
        "k": args.k,
        "top_heads": [f"{la}-{h}" for la, h in top[:8]],
        **res,
        "prefill_seconds": round(seconds, 1),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
