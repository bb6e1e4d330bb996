"""QRHead scores and the attention retriever against a re-implementation of the reference.

The oracle re-implements `princeton-pli/QRHead`, `src/qrretriever/attn_retriever.py`:
`score_per_token_attention_to_query` (softmax attention of the query-span rows on every key, averaged
over the rows, stacked over layers), the null-query calibration of `score_docs` /
`score_docs_per_head_for_detection` (`per_token_scores[..., :min_length] - null[..., :min_length]`),
their outlier filter (`threshold = mean - 2 * std`, keep `> threshold`, sum) and `lme_eval` (mean of
the gold passage's score per head). The attention comes from `tests.support.oracle.llama_forward`,
a hand-written forward, not from headsteer's engine.
"""

from __future__ import annotations

import pytest
import torch

from heads import encode_prompts
from heads.errors import HeadsteerValueError
from heads.scorers.retrieval.qrhead import qr_prompt, qr_retrieve, qr_tokens, qrhead_scores, recall_at
from probes.datasets.make_retrieval import FIRST, LAST, build, load_retrieval
from tests.support import make_tiny
from tests.support.oracle import llama_forward

ITEMS = [
    {
        "question": "Where was Orlan Vesk born?",
        "passages": [
            "Mira Tael was born in Kestra.",
            "Orlan Vesk came into the world in Delmar.",
            "Orlan Vesk plays the cello.",
        ],
        "gold": 1,
    },
    {
        "question": "What pet does Ilse Pell own?",
        "passages": [
            "Ilse Pell works as a nurse.",
            "Tobin Rowe owns a pet ferret.",
            "Ilse Pell has a parrot.",
        ],
        "gold": 2,
    },
]


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return make_tiny("llama", tokenizer, num_hidden_layers=2)


def _reference_per_token(model, prompt):
    """`[L, H, P]` per-token scores of the reference, and the query span start."""
    enc = encode_prompts(model.tokenizer, [prompt], chat=False)
    q0 = enc.spans[0][-1][0]
    pats = []

    def keep(li, p):
        pats.append(p[0])
        return p

    llama_forward(model.model, enc.input_ids, enc.attention_mask, transform=keep)
    per = [p[:, q0:, :].mean(1) for p in pats]  # attn_weights.mean(1): over the query tokens
    return torch.stack(per, 0), enc


def _reference_item(model, item, null="N/A"):
    s, enc = _reference_per_token(model, qr_prompt(item["question"], item["passages"]))
    n, _ = _reference_per_token(model, qr_prompt(null, item["passages"]))
    m = min(s.shape[-1], n.shape[-1])
    cal = s[:, :, :m] - n[:, :, :m]
    spans = enc.spans[0][:-1]
    per_head = []
    for t0, t1 in spans:
        cur = cal[:, :, t0:t1]
        thr = cur.mean(dim=-1) - 2 * cur.std(dim=-1)
        per_head.append(cur.masked_fill(~(cur > thr.unsqueeze(-1)), 0.0).sum(-1))
    return cal, spans, torch.stack(per_head), enc


def test_head_scores_and_retrieval_equal_the_reference(tiny):
    ref_total = torch.zeros(tiny.n_layers, tiny.n_heads)
    for item in ITEMS:
        cal, spans, per_head, enc = _reference_item(tiny, item)
        # spans are the reference's doc_content "[i] text" (found independently by decoding)
        for i, (t0, t1) in enumerate(spans):
            text = tiny.tokenizer.decode(enc.input_ids[0, t0:t1]).strip()
            assert text == f"[{i + 1}] {item['passages'][i]}"
        got = qr_tokens(tiny, item["question"], item["passages"], chat=False)
        torch.testing.assert_close(got.scores, cal, atol=1e-6, rtol=1e-5)
        assert got.spans == [tuple(s) for s in spans]
        ref_total += per_head[item["gold"]]
        # retrieval: selected heads summed first, then the filter (score_docs)
        heads = [(0, 1), (1, 2), (1, 0)]
        x = cal[[0, 1, 1], [1, 2, 0]].sum(0)
        want = []
        for t0, t1 in spans:
            cur = x[t0:t1]
            thr = cur.mean() - 2 * cur.std()
            want.append((cur * (cur > thr)).sum())
        torch.testing.assert_close(qr_retrieve(tiny, "", [], heads, tokens=got), torch.stack(want))
        all_x = cal.sum(0).sum(0)
        full = [
            (all_x[a:b] * (all_x[a:b] > all_x[a:b].mean() - 2 * all_x[a:b].std())).sum() for a, b in spans
        ]
        torch.testing.assert_close(qr_retrieve(tiny, "", [], None, tokens=got), torch.stack(full))
    hs = qrhead_scores(tiny, ITEMS, chat=False, progress=False)
    torch.testing.assert_close(hs.scores, ref_total / len(ITEMS), atol=1e-6, rtol=1e-5)
    assert hs.method == "qrhead" and hs.scores.abs().sum() > 0


def test_recall_and_bad_input(tiny):
    assert recall_at(torch.tensor([0.1, 0.5, 0.3]), 1, 1) == 1.0
    assert recall_at(torch.tensor([0.1, 0.5, 0.3]), 2, 1) == 0.0
    assert recall_at(torch.tensor([0.1, 0.5, 0.3]), 2, 2) == 1.0
    with pytest.raises(HeadsteerValueError, match="passages"):
        qr_prompt("q?", ["only one"])
    with pytest.raises(HeadsteerValueError, match="question"):
        qr_prompt("", ["a", "b"])
    with pytest.raises(HeadsteerValueError, match="gold"):
        qrhead_scores(tiny, [{"question": "q?", "passages": ["a", "b"], "gold": 5}], progress=False)
    with pytest.raises(HeadsteerValueError, match="items"):
        qrhead_scores(tiny, [], progress=False)
    with pytest.raises(HeadsteerValueError, match="heads"):
        qr_retrieve(tiny, "q?", ["a", "b"], [])
    with pytest.raises(HeadsteerValueError, match="layer"):
        qr_retrieve(tiny, "q?", ["a", "b"], [(9, 0)])


def test_shipped_set_is_the_generators_output():
    rows = load_retrieval()
    assert rows == build()
    assert len(rows) >= 60 and {r["split"] for r in rows} == {"train", "test"}
    for r in rows:
        assert len(r["passages"]) == 10 and 0 <= r["gold"] < 10
        names = [f"{a} {b}" for a in FIRST for b in LAST if f"{a} {b}" in r["question"]]
        assert len(names) == 1 and names[0] in r["passages"][r["gold"]]
        assert sum(names[0] in p for p in r["passages"]) == 4  # the answer and three hard negatives
