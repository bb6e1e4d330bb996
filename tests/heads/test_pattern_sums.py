"""The pattern readers' one-pass reductions equal the per-detector reductions they replaced.

`pattern_scores` reads every detector from one pass over each query block
(`heads.scorers.roles.pattern_sums.block_sums`: one matrix product with the stacked key masks, a
gather for previous-token and self) and `sink_stats` sums the columns with one product per
(batch row, head). The reductions they replaced are written out below (one masked product and
sum per detector, the full `[B, q, K]` masks; an einsum for the column sums) and forced in place
of the new ones: the results agree within 1e-6 on families with a sliding window shorter than the
prompt (Mistral; Gemma-2 with soft-capping and local / global layers; gpt-oss with learned
sinks, whose rows sum to less than 1), on a left-padded batch, in many small blocks, for every
`rows` / `exclude_bos` / `exclude_current_token` setting.
"""

from __future__ import annotations

import pytest
import torch

import heads.engine.state as engine_state
import heads.scorers.roles.detectors as detectors
import heads.scorers.sinks as sinks
from heads.inputs.prompts import EncodedPrompts
from heads.scorers.roles.detectors import PATTERN_DETECTORS, pattern_scores
from heads.scorers.sink_requests import SinkStatsRequest
from heads.scorers.sinks import SinkRule, run_sink_stats
from tests.support.families import WINDOW, shared_family_model


def _per_detector_sums(probs, a, ids, real, first, names, rows, exclude_bos, exclude_current_token):
    """The reduction `block_sums` replaced: full `[B, q, K]` detection masks, one masked product
    and sum over the keys per detector."""
    b, k_len = a + probs.shape[2], probs.shape[-1]
    qpos, kpos = torch.arange(a, b)[:, None], torch.arange(k_len)[None, :]
    rq, rk = real[:, a:b], real[:, :k_len]
    pair = rq[:, :, None] & rk[:, None, :]
    causal, strict = (kpos <= qpos)[None], (kpos < qpos)[None]
    same = ids[:, a:b, None] == ids[:, None, :k_len]
    ind = torch.zeros_like(pair)
    prev_same = ids[:, a:b, None] == ids[:, None, : k_len - 1]
    before = (kpos[:, :-1] < qpos)[None]
    ind[:, :, 1:] = prev_same & before & rq[:, :, None] & rk[:, None, :-1] & rk[:, None, 1:]
    masks = {
        "previous_token": (kpos == qpos - 1)[None] & pair,
        "duplicate_token": same & strict & pair,
        "induction": ind & causal,
        "self": (kpos == qpos)[None] & pair,
        "visible": causal & pair,
    }
    p = probs.float()
    kp = masks["visible"].clone()
    if exclude_bos:
        kp &= kpos[None] != first[:, None, None]
    if exclude_current_token:
        kp &= ~(kpos == qpos)[None]
    pk = p * kp[:, None]
    row_mass = pk.sum(-1)
    out = {}
    for n in names:
        if n == "entropy":
            n_vis = masks["visible"].sum(-1)
            ent = -(p * torch.log(p.clamp(min=1e-30))).sum(-1)
            ok = n_vis >= 2
            norm = torch.log(n_vis.clamp(min=2).float())
            rows_ok = ok.sum(-1)[:, None].float().expand_as(ent[..., 0])
            out[n] = ((ent / norm[:, None] * ok[:, None]).sum(-1), rows_ok)
            continue
        d = masks[n] & kp
        num = (pk * d[:, None]).sum(-1)
        counted = d.any(-1) if rows == "target" else masks["visible"].any(-1)
        out[n] = ((num * counted[:, None]).sum(-1), (row_mass * counted[:, None]).sum(-1))
    return out


def _padded_repeats(n_vocab: int) -> EncodedPrompts:
    """Three rows of [first] + R + R (R of 12 and 9 tokens, random), the shorter left-padded:
    29 and 19 real tokens, far past the sliding window (6)."""
    g = torch.Generator().manual_seed(11)
    rows = []
    for n in (12, 9, 12):
        r = torch.randint(10, n_vocab, (n,), generator=g)
        rows.append(torch.cat([torch.tensor([3]), r, r, r[:4]]))
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, t - len(r) :], mask[b, t - len(r) :] = r, 1
    return EncodedPrompts(ids, mask, [[]] * len(rows), [""] * len(rows), [[]] * len(rows))


@pytest.mark.parametrize(
    ("kind", "blocks"),
    [("mistral", "whole"), ("mistral", "small"), ("gemma2", "small"), ("gpt_oss", "small")],
)
def test_one_pass_detectors_equal_per_detector_sums(monkeypatch, kind, blocks):
    model = shared_family_model(kind)
    enc = _padded_repeats(model.d_vocab)
    assert enc.length > 4 * WINDOW and (enc.attention_mask == 0).any()
    if blocks == "small":  # 2 query rows per (batch row x head): many blocks, keys past each block
        monkeypatch.setattr(engine_state, "READ_BLOCK_ROW_HEADS", 8)
        monkeypatch.setattr(engine_state, "READ_BLOCK_ELEMENTS", 1)
    settings = [  # each flag on and off, each `rows`
        dict(rows="target", exclude_bos=False, exclude_current_token=False),
        dict(rows="target", exclude_bos=True, exclude_current_token=False),
        dict(rows="all", exclude_bos=False, exclude_current_token=True),
        dict(rows="target", exclude_bos=True, exclude_current_token=True),
    ]
    new = [pattern_scores(model, enc, **s) for s in settings]
    with monkeypatch.context() as m:
        m.setattr(detectors, "block_sums", _per_detector_sums)
        old = [pattern_scores(model, enc, **s) for s in settings]
    for s, got, want in zip(settings, new, old, strict=True):
        for n in PATTERN_DETECTORS:
            assert torch.equal(got[n].scores.isnan(), want[n].scores.isnan()), (s, n)
            torch.testing.assert_close(
                got[n].scores, want[n].scores, atol=1e-6, rtol=0, equal_nan=True, msg=f"{s} {n}"
            )
            # something was scored (but self without the current token: no target key at all)
            empty = n == "self" and s["exclude_current_token"] and s["rows"] == "target"
            assert want[n].scores.isnan().all() == empty, (s, n)
    # the detectors differ from one another (the comparison is not of a constant)
    assert not torch.allclose(new[0]["previous_token"].scores, new[0]["induction"].scores)


@pytest.mark.parametrize("kind", ["mistral", "gpt_oss"])
def test_column_sums_equal_the_einsum(monkeypatch, kind):
    """Sink statistics with the column sums as the einsum they replaced: the same statistics."""
    model = shared_family_model(kind)
    enc = _padded_repeats(model.d_vocab)
    monkeypatch.setattr(engine_state, "READ_BLOCK_ROW_HEADS", 8)
    monkeypatch.setattr(engine_state, "READ_BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(sinks, "encode_prompts", lambda *a, **k: enc)  # token ids, no tokenizer
    monkeypatch.setattr(sinks, "readable_tokens", lambda tok, r: [str(int(t)) for t in r])
    rule = SinkRule(rule="absolute", theta=0.05)
    request = SinkStatsRequest(rule=rule.rule, theta=rule.theta, chat=False, markup=False)
    new = run_sink_stats(model, ["x"], request)
    monkeypatch.setattr(sinks, "_column_sums", lambda p, w: torch.einsum("bhqk,bq->bhk", p.float(), w))
    old = run_sink_stats(model, ["x"], request)
    assert len(old.flagged) > 0  # some column was flagged
    for name in ("sink_mass", "first_mass", "n_sinks"):
        torch.testing.assert_close(getattr(new, name).scores, getattr(old, name).scores, atol=1e-6, rtol=0)
    where = ["prompt", "layer", "head", "position"]
    assert new.flagged[where].equals(old.flagged[where])
