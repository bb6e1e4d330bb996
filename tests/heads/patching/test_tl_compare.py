"""Activation and path patching equal TransformerLens' `patching` functions on the same weights.

A plain HF tiny model (headsteer) and a TransformerLens `TransformerBridge` booted over a second
copy with the same seed (the bridge runs the HF modules, no weight processing). Pairs of equal
token length, so neither side pads (TransformerLens' sweeps take token ids without a mask).
"""

from __future__ import annotations

import pytest
import torch

from heads import SweepOptions
from heads.scorers.patching import encode_pairs, path_patch
from heads.scorers.patching.activation import patch
from heads.scorers.patching.pairs import PromptPair
from tests.support import make_tiny
from tests.support.patching import state_copy

P = pytest.importorskip("transformer_lens.patching")

PAIRS = [
    PromptPair(
        "When Mary and John went to the store, John gave a drink to",
        "When Mary and John went to the store, Mary gave a drink to",
        " Mary",
        " John",
    ),
    PromptPair(
        "When Anna and Tom went to the park, Tom gave a drink to",
        "When Anna and Tom went to the park, Anna gave a drink to",
        " Anna",
        " Tom",
    ),
]
OPTS = SweepOptions(max_rows=32, progress=False)
TOL = 1e-5


def _pair(kind, tokenizer):
    from transformer_lens.model_bridge import TransformerBridge

    hf = make_tiny(kind, tokenizer)
    bridge = TransformerBridge.boot_transformers(
        "tiny", hf_model=make_tiny(kind, tokenizer).model, tokenizer=tokenizer
    )
    pairs = encode_pairs(tokenizer, PAIRS)
    assert bool(pairs.attention_mask.all())  # no padding: both sides see the same positions
    return hf, bridge, pairs


def _ld(pairs):
    c, w = pairs.answers[:, 0], pairs.counterfactuals[:, 0]
    rows = torch.arange(pairs.n)

    def metric(logits):  # [N, T, V] -> [N]
        last = logits[:, -1].float()
        return last[rows, c] - last[rows, w]

    return metric


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_head_out_equals_transformer_lens(tokenizer, kind):
    hf, bridge, pairs = _pair(kind, tokenizer)
    _, clean_cache = bridge.run_with_cache(pairs.clean_ids)
    metric = _ld(pairs)
    before = state_copy(hf)
    ours = patch(hf, pairs, "head_out", options=OPTS)
    assert all(torch.equal(v, before[k]) for k, v in hf.model.state_dict().items())
    tl = P.get_act_patch_attn_head_out_all_pos(
        bridge, pairs.corrupted_ids, clean_cache, metric, reduce="none"
    )
    assert tl.values.shape == ours.raw.shape  # [L, H, N]
    assert float((tl.values.cpu() - ours.raw).abs().max()) < TOL
    positions = [3, 9, 13]
    ours = patch(hf, pairs, "head_out_by_pos", positions=positions, options=OPTS)
    assert all(torch.equal(v, before[k]) for k, v in hf.model.state_dict().items())
    import pandas as pd

    L, H = hf.n_layers, hf.n_heads
    cells = [(la, p, h) for la in range(L) for p in positions for h in range(H)]
    index_df = pd.DataFrame(cells, columns=["layer", "pos", "head"])
    tl = P.get_act_patch_attn_head_out_by_pos(
        bridge,
        pairs.corrupted_ids,
        clean_cache,
        metric,
        index_axis_names=None,
        index_df=index_df,
        reduce="none",
    )  # flattened over the rows of index_df: [L * 3 * H, N]
    want = tl.values.cpu().reshape(L, len(positions), H, pairs.n).permute(0, 2, 1, 3)
    assert float((want - ours.raw).abs().max()) < TOL


@pytest.mark.parametrize(("kind", "components"), [("llama", ["q"]), ("gpt2", ["q", "k", "v"])])
def test_path_equals_direct_path(tokenizer, kind, components):
    """Receiver = one head's q / k / v, MLPs frozen, denoising: TransformerLens' direct path
    (the sender's clean-minus-corrupted write added to the receiver's own residual copy).
    TransformerLens refuses k / v under GQA, so the GQA Llama compares q only."""
    hf, bridge, pairs = _pair(kind, tokenizer)
    _, clean_cache = bridge.run_with_cache(pairs.clean_ids)
    _, corrupt_cache = bridge.run_with_cache(pairs.corrupted_ids)
    metric = _ld(pairs)
    L, H = hf.n_layers, hf.n_heads
    sender = (0, 1)
    before = state_copy(hf)
    for comp in components:
        tl = P.get_act_patch_direct_path(
            bridge,
            pairs.corrupted_ids,
            clean_cache,
            corrupt_cache,
            lambda lg: metric(lg).mean(),
            *sender,
            component=comp,
            verbose=False,
        )
        for la in range(sender[0] + 1, L):
            for h in range(H):
                ours = path_patch(
                    hf,
                    pairs,
                    [sender],
                    [(la, h)],
                    inputs=comp,
                    mlp="frozen",
                    direction="denoising",
                    options=OPTS,
                )
                got = ours.raw[sender].mean()
                assert abs(float(got) - float(tl[la, h])) < TOL, (comp, la, h, float(got), float(tl[la, h]))
    assert all(torch.equal(v, before[k]) for k, v in hf.model.state_dict().items())
