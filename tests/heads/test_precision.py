"""Edited layers compute in the model's own precision and order of operations (bf16, fp16, fp32).

* A read-only edit (`Recorder`) on every layer changes no bit of the logits, with either
  attention base (eager, SDPA), in every dtype.
* A steering edit equals the model computing the same edit in its own dtype: an oracle
  attention function written from transformers' `eager_attention_forward` (logits and mask in
  the model's dtype, softmax in fp32, the pattern rounded before the values), with the edit's
  bias added to the mask and its pattern map applied to the fp32 softmax.
* What a user's edit returns is cast to the model's dtype (issue: a `HeadOutputEdit` adding an
  fp32 tensor to a bf16 model failed inside `o_proj`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from heads import HeadOutputEdit, LogitBias, QueryEdit, Recorder, editing, encode_prompts, forward
from heads.engine.edits import AttentionCall, ProbEdit
from heads.scorers.sinks import SinkRule
from steer import Pasta
from steer.act.method import Act
from steer.spotlight import Spotlight
from tests.support import Identity, make_tiny

PROMPT = "Context: the sky is green today. **Answer in one word.** What colour is the sky?"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS = {"0": [1], "1": [0, 3], "2": [2]}


_MODELS: dict = {}


def _model(tokenizer, attn: str, dtype: torch.dtype):
    hm = _MODELS.get((attn, dtype))
    if hm is None:
        hm = _MODELS[(attn, dtype)] = make_tiny("llama", tokenizer, attn=attn)
        hm.model.to(dtype)
    return hm


@pytest.fixture(scope="module")
def enc(tokenizer):
    return encode_prompts(tokenizer, [PROMPT], chat=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_recorder_on_every_layer_is_bitwise_a_no_op(tokenizer, enc, attn, dtype):
    hm = _model(tokenizer, attn, dtype)
    base = forward(hm, enc)
    recs = [Recorder(layer=la) for la in range(hm.n_layers)]
    with editing(hm, recs):
        got = forward(hm, enc)
    assert torch.equal(got, base)
    pattern = recs[1].records[0]  # fp32 [B, H, Q, K]
    assert pattern.dtype == torch.float32
    torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_recorded_pattern_is_the_models_own_in_eager(tokenizer, enc, dtype):
    hm = _model(tokenizer, "eager", dtype)
    with torch.no_grad():
        own = hm.model(enc.input_ids, output_attentions=True).attentions[2]
    rec = Recorder(layer=2)
    with editing(hm, rec):
        forward(hm, enc)
    assert torch.equal(rec.records[0].to(dtype), own)


# ------------------------------------------------------------------ the oracle: eager + the edit
_ORACLE: dict[int, list] = {}


def _oracle_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    """transformers' eager attention in the model's dtype, with the layer's edits (written from
    `transformers.models.llama.modeling_llama.eager_attention_forward`)."""
    groups = module.num_key_value_groups
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    b, h, q_len, k_len = w.shape
    call = AttentionCall(module.layer_idx, b, h, q_len, k_len, k_len - q_len, query.device)
    edits = _ORACLE.get(module.layer_idx, [])
    mask = attention_mask.float()
    for e in edits:
        if isinstance(e, LogitBias):
            heads = e.head_mask(b, h, query.device)[:, :, None, None]
            mask = mask + torch.where(heads, e.bias(call).float(), 0.0)
    w = w + mask.clamp(min=torch.finfo(query.dtype).min).to(query.dtype)
    p = torch.softmax(w, dim=-1, dtype=torch.float32)
    visible = attention_mask > torch.finfo(query.dtype).min / 2
    for e in edits:
        if isinstance(e, ProbEdit):
            heads = e.head_mask(b, h, query.device)[:, :, None, None]
            p = torch.where(visible, torch.where(heads, e.apply(p, call), p), 0.0)
    out = torch.matmul(p.to(query.dtype), value)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("f2_oracle", _oracle_attention)
AttentionMaskInterface.register("f2_oracle", eager_mask)


def _oracle_logits(hm, enc, edits):
    cfg = hm.model.config
    before = cfg._attn_implementation
    _ORACLE.clear()
    for e in edits:
        _ORACLE.setdefault(e.layer, []).append(e)
    cfg._attn_implementation_internal = "f2_oracle"
    try:
        return forward(hm, enc)
    finally:
        cfg._attn_implementation_internal = before
        _ORACLE.clear()


def _methods():
    return {
        "pasta": lambda hm, enc: Pasta(HEADS, alpha=0.01).edits(hm, enc),
        "spotlight": lambda hm, enc: Spotlight(tau=0.5, granularity="row").edits(hm, enc),
        "act": lambda hm, enc: Act(
            heads={1: [1], 2: [0, 2]}, rule=SinkRule(rule="absolute", theta=0.05)
        ).edits(hm, enc),
        "identity": lambda hm, enc: [Identity(layer=la) for la in range(hm.n_layers)],
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("method", list(_methods()))
def test_steering_equals_the_model_computing_the_edit_in_its_dtype(tokenizer, enc, method, dtype):
    hm = _model(tokenizer, "eager", dtype)
    make = _methods()[method]
    edits = make(hm, enc)
    assert edits, method
    with editing(hm, edits, kernel="blocked"):
        got = forward(hm, enc)
    want = _oracle_logits(hm, enc, make(hm, enc))
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=0)
    if method != "identity":
        assert (got.float() - forward(hm, enc).float()).abs().max() > 1e-3  # the steering shows
    else:
        assert torch.equal(got, forward(hm, enc))  # a pass-through pattern edit: bitwise


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sdpa_steering_is_within_rounding_of_fp32(tokenizer, enc, dtype):
    """On an SDPA model the edited layer computes as SDPA's kernels do (fp32 inside); the
    steered logits stay as close to the fp32 steered logits as the unsteered ones do."""
    hm32 = _model(tokenizer, "sdpa", torch.float32)
    hm = _model(tokenizer, "sdpa", dtype)
    make = _methods()["spotlight"]
    with editing(hm32, make(hm32, enc)):
        ref = forward(hm32, enc)
    with editing(hm, make(hm, enc)):
        got = forward(hm, enc).float()
    plain_err = (forward(hm, enc).float() - forward(hm32, enc)).abs().max()
    assert (got - ref).abs().max() <= 2 * plain_err + 1e-3


# ------------------------------------------------------------------ user edits: dtype and device
class _AddOnes(HeadOutputEdit):
    def apply(self, z, call):
        return z + 0.5 * torch.ones(z.shape[-1])  # fp32, on the CPU


class _QueryAdd(QueryEdit):
    def apply(self, q, call):
        return q + torch.ones(q.shape[-1], dtype=torch.float64)


class _Bias64(LogitBias):
    def bias(self, call):
        b = torch.zeros((1, 1, 1, call.k_len), dtype=torch.float64)
        b[..., 1::2] = -3.0  # every other key
        return b


@pytest.mark.parametrize("edit", [_AddOnes(1, heads=[0]), _QueryAdd(1, heads=[2]), _Bias64(0, heads=[1])])
def test_user_edits_are_cast_to_the_models_dtype(tokenizer, enc, edit):
    hm = _model(tokenizer, "sdpa", torch.bfloat16)
    with editing(hm, edit):
        got = forward(hm, enc)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert (got.float() - forward(hm, enc).float()).abs().max() > 0


def test_user_edit_of_the_wrong_shape_is_named(tokenizer, enc):
    class Bad(HeadOutputEdit):
        def apply(self, z, call):
            return z[..., :1]

    hm = _model(tokenizer, "sdpa", torch.bfloat16)
    with pytest.raises(ValueError, match=r"Bad\(layer=0.*must return the shape"):
        with editing(hm, Bad(0)):
            forward(hm, enc)
