"""Two published mechanisms read back with QK attribution on the embedded SmolLM2-135M-Instruct.

A study, not a test: it prints one JSON line with what holds and what does not.

* **Induction** (Olsson et al. 2022): for the top 5 heads of the induction detector
  (`pattern_scores`, default rows), on 4 rows `[BOS] + R + R` (R: 20 random tokens, seed 1), the
  cell from token R[10] of the second copy to the token after its first occurrence: the largest
  key-side head, its previous-token rank, the source position it read (relative to the key), its
  weight-based K-composition into the induction head (and rank among the writers), the largest
  query-side component.
* **IOI** (Wang et al. 2023): name movers = the 3 heads with the most attention from END to the
  indirect object among heads with DLA > 0.1 on 8 shipped IOI pairs (ABC corruption). For each,
  the query-side and key-side marginals at (END, IO) minus at (END, S1) (what makes IO win over
  the subject), summed over the movers per upstream head, against path patching of every sender
  head into the movers' queries (`path_patch(receivers=movers, inputs="q")`, noising): the top
  senders of each, their overlap, and the correlation over the heads below the movers.

Usage: `python benchmarks/qk_mechanisms.py` (about 30 CPU minutes, most of it path patching;
`--no-path-patching` for the QK part alone).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from heads import composition_scores, load_model, qk_attribution, qk_attributions
from heads.engine.edits import Recorder
from heads.engine.options import SweepOptions
from heads.engine.variants import run_rows
from heads.inputs.prompts import EncodedPrompts
from heads.scorers.patching import direct_logit_attribution, encode_pairs, path_patch
from heads.scorers.roles.detectors import pattern_scores, repeated_tokens


def induction(m) -> list[dict]:
    sc = pattern_scores(m, detectors=["induction", "previous_token"])
    ind, prev = sc["induction"], sc["previous_token"]
    prev_rank = {hd: i for i, hd in enumerate(prev.ranked(m.n_layers * m.n_heads))}
    n = 20
    enc = repeated_tokens(m, n_seqs=4, length=(n, n), seed=1)
    i = n // 2
    q, k = n + 1 + i, 2 + i
    rows = []
    for la, h in ind.ranked(5):
        r = qk_attribution(m, enc, (la, h), query=q, by="source_token")
        km = r.key_marginals()[:, 0, k].mean(0)
        qm = r.query_marginals()[:, 0, k].mean(0)
        heads = [c for c, nm in enumerate(r.names) if nm.startswith("L") and "H" in nm]
        best = max(heads, key=lambda c: float(km[c]))
        name = r.names[best]
        lb, hb = (int(x) for x in name[1:].split("H"))
        src = r.sources["key"][:, 0, k, r.source_heads.index(name)].sum(0)
        cs = composition_scores(m, readers=[(la, h)])
        k_rank = cs.head_scores("k", reader=(la, h)).ranked(m.n_heads * la)
        top_q = int(qm.abs().argmax())
        rows.append(
            {
                "head": f"L{la}H{h}",
                "induction_score": round(float(ind.scores[la, h]), 3),
                "attention_at_target": round(float(r.pattern[:, 0, k].mean()), 3),
                "max_error": r.max_error(),
                "top_key_head": name,
                "its_key_marginal": round(float(km[best]), 2),
                "its_previous_token_rank": prev_rank[(lb, hb)],
                "its_source_minus_key": int(src.abs().argmax()) - k,
                "its_k_composition": round(float(cs.k[lb, hb, la, h]), 3),
                "its_k_composition_rank": k_rank.index((lb, hb)),
                "top_query_component": [r.names[top_q], round(float(qm[top_q]), 2)],
            }
        )
    return rows


def ioi(m, n_pairs: int, path: bool) -> dict:
    from probes.datasets.pairs import load_task_pairs

    pairs = encode_pairs(m, load_task_pairs("ioi", n=n_pairs))
    N, T = pairs.clean_ids.shape
    dla = direct_logit_attribution(m, pairs).head_scores()
    recs = [Recorder(layer=la, fn=lambda p, c: p[:, :, -1].clone()) for la in range(m.n_layers)]
    run_rows(m, pairs.clean_ids, pairs.attention_mask, recs)
    ends = torch.stack([r.records[0] for r in recs], 1)  # [N, L, H, T] attention from END
    io_pos, s_pos, io_cols = [], [], []
    for n in range(N):
        pad = T - int(pairs.attention_mask[n].sum())
        row = pairs.clean_ids[n].tolist()
        io_col = row.index(int(pairs.answers[n, 0]), pad)
        io_cols.append(io_col)
        io_pos.append(io_col - pad)
        s_pos.append(row.index(int(pairs.counterfactuals[n, 0]), pad) - pad)
    att_io = torch.stack([ends[n, :, :, c] for n, c in enumerate(io_cols)]).mean(0)
    cands = [(a, b) for a in range(m.n_layers) for b in range(m.n_heads) if float(dla.scores[a, b]) > 0.1]
    movers = sorted(cands, key=lambda x: -float(att_io[x]))[:3]
    enc = EncodedPrompts(
        pairs.clean_ids, pairs.attention_mask, [[] for _ in range(N)], [""] * N, [[] for _ in range(N)]
    )
    out: dict = {"movers": [], "name_movers": [f"L{a}H{b}" for a, b in movers]}
    agg: dict[str, float] = {}
    for r in qk_attributions(m, enc, movers, query=-1, by="source_token"):
        ki_io = [r.keys[n].tolist().index(p) for n, p in enumerate(io_pos)]
        ki_s = [r.keys[n].tolist().index(p) for n, p in enumerate(s_pos)]

        def at(mg: torch.Tensor, kis: list[int]) -> torch.Tensor:
            return torch.stack([mg[n, 0, k] for n, k in enumerate(kis)]).mean(0)

        qm, km = r.query_marginals(), r.key_marginals()
        dq, dk, kio = at(qm, ki_io) - at(qm, ki_s), at(km, ki_io) - at(km, ki_s), at(km, ki_io)
        heads = [c for c, nm in enumerate(r.names) if nm.startswith("L") and "H" in nm]
        for c in heads:
            agg[r.names[c]] = agg.get(r.names[c], 0.0) + float(dq[c])

        def top(v: torch.Tensor, idx: list[int], k: int = 4, names: list[str] = r.names) -> list:
            return [
                [names[c], round(float(v[c]), 2)] for c in sorted(idx, key=lambda c: -abs(float(v[c])))[:k]
            ]

        every = list(range(len(r.names)))
        out["movers"].append(
            {
                "head": f"L{r.layer}H{r.head}",
                "dla": round(float(dla.scores[r.layer, r.head]), 3),
                "attention_io": round(
                    float(torch.stack([r.pattern[n, 0, k] for n, k in enumerate(ki_io)]).mean()), 3
                ),
                "attention_s1": round(
                    float(torch.stack([r.pattern[n, 0, k] for n, k in enumerate(ki_s)]).mean()), 3
                ),
                "max_error": r.max_error(),
                "query_side_io_minus_s1": top(dq, every),
                "key_side_io_minus_s1": top(dk, every),
                "key_side_at_io": top(kio, every),
                "max_abs_query_side_diff": round(float(dq.abs().max()), 2),
                "max_abs_key_side_diff": round(float(dk.abs().max()), 2),
            }
        )
    ranked = sorted(agg, key=lambda k: -abs(agg[k]))
    out["qk_query_side_top"] = [[k, round(agg[k], 3)] for k in ranked[:6]]
    if path:
        pp = path_patch(
            m, pairs, receivers=movers, inputs="q", options=SweepOptions(progress=False)
        ).head_scores()
        lo = min(a for a, _ in movers)
        below = [(a, b) for a in range(lo) for b in range(m.n_heads)]
        by_abs = sorted(below, key=lambda x: -abs(float(pp.scores[x])))
        out["path_patching_top"] = [[f"L{a}H{b}", round(float(pp.scores[a, b]), 3)] for a, b in by_abs[:6]]
        pv = torch.tensor([float(pp.scores[x]) for x in below])
        qv = torch.tensor([agg[f"L{a}H{b}"] for a, b in below])
        out["pearson_path_patching_vs_qk"] = round(float(torch.corrcoef(torch.stack([pv, qv]))[0, 1]), 3)
        top_p = {k for k, _ in out["path_patching_top"][:5]}
        out["top5_overlap"] = sorted(top_p & {k for k, _ in out["qk_query_side_top"][:5]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--no-path-patching", action="store_true")
    args = ap.parse_args()
    m = load_model()
    line = {
        "benchmark": "qk_mechanisms",
        "model": "SmolLM2-135M-Instruct",
        "load_average": os.getloadavg()[0],
    }
    line["induction"] = induction(m)
    line["ioi"] = ioi(m, args.pairs, not args.no_path_patching)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
