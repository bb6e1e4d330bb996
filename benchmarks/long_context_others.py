"""The sections of `long_context_analyses.py` beside the analyses: the peers (TransformerLens,
nnsight), the memory plan against measured peaks, and Gemma-3-270m at 16k / 32k tokens."""

from __future__ import annotations

import gc
import os
import sys

from long_context_common import ANSWERS, cap, child, guarded, pair, prompt, status, task_text
from long_context_summary import gemma_entry, peer_entries, plan_entries


# ------------------------------------------------------------------------------ the peers
def peer(name: str, length: int, args) -> dict:
    """TransformerLens `run_with_cache` or an nnsight pattern-saving trace on `length` token ids."""
    import torch

    from heads import load_model
    from heads.model.loading import wrap_backend

    hm = load_model(device=args.device, attn_implementation="eager" if name == "nnsight" else None)
    ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(2))
    if name == "transformer_lens":
        bridge = wrap_backend(
            hm.model, hm.tokenizer, "HuggingFaceTB/SmolLM2-135M-Instruct", "transformer_lens"
        )

        def run() -> None:
            with torch.no_grad():
                _, cache = bridge.run_with_cache(ids)
                del cache

        warm = ids[:, :128]
        with torch.no_grad():
            bridge.run_with_cache(warm)
    else:
        nn_model = wrap_backend(hm.model, hm.tokenizer, hm.name, "nnsight")
        layers = hm.model.model.layers

        def run() -> None:
            kept: list = []  # the saved patterns, alive until the trace returns them
            with torch.no_grad(), nn_model.trace(ids, output_attentions=True):
                kept.extend(layer.self_attn.output[1].save() for layer in nn_model.model.layers)
            assert len(kept) == hm.n_layers

        assert len(layers) == hm.n_layers
    cap(args.cap_gb)
    return guarded(run, args.device)


def peers(args, line: dict) -> None:
    for name in ("transformer_lens", "nnsight"):
        runs: list[tuple[int, dict]] = []
        for length in args.lengths:
            got = child(["--peer", name, str(length)], args)
            print(f"peer {name} {length}: {got}", file=sys.stderr, flush=True)
            runs.append((length, got))
            if "failed" in got:
                break
        peer_entries(line, name, runs)


# ------------------------------------------------------------------------------ the plan check
PLAN_MODELS = {  # published configs (fewer layers nowhere: the whole model), random weights
    "0.1B": (
        "llama",
        dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
             tie_word_embeddings=True, rope_theta=100000.0),
    ),
    "0.5B": (
        "qwen2",
        dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
             tie_word_embeddings=True, rope_theta=1000000.0),
    ),
    "1B": (
        "llama",
        dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
             tie_word_embeddings=True, rope_theta=500000.0),
    ),
}  # fmt: skip
PLAN_CASES = [  # (model, dtype, request, tokens)
    ("0.1B", "float32", "forward", 2048),
    ("0.1B", "bfloat16", "forward", 2048),
    ("0.1B", "float32", "sinks", 2048),
    ("0.1B", "float32", "gradient", 1024),
    ("0.5B", "float32", "forward", 2048),
    ("0.5B", "bfloat16", "forward", 2048),
    ("1B", "bfloat16", "forward", 2048),
    ("1B", "bfloat16", "sinks", 1024),
    ("0.1B", "float32", "patch", 1024),  # PATCH_PLAN: the default (lean) path at a long prompt
]
PATCH_PLAN = {"kind": "resid_pre", "layers": [15], "positions": [-1]}


def plan_one(model: str, dtype: str, request: str, tokens: int, args) -> dict:
    """Measured (weights + activation peak, RSS) against `plan_memory` for one case."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from heads import HeadModel, load_tokenizer, plan_memory
    from heads.scorers.sinks import sink_stats

    kind, values = PLAN_MODELS[model]
    cfg = AutoConfig.for_model(kind, **values)
    dt = getattr(torch, dtype)
    tok = load_tokenizer() if request == "sinks" else None
    text = task_text(tok, tokens) if tok is not None else None
    from heads.planning import MemoryRequest

    plan = plan_memory(
        cfg, MemoryRequest("patch", PATCH_PLAN) if request == "patch" else request, tokens, 1, dt
    )
    gc.collect()
    before = status("VmRSS")
    torch.manual_seed(0)
    model_ = AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation="sdpa").eval()
    gc.collect()
    weights = status("VmRSS") - before
    ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model_(input_ids=ids[:, :64], use_cache=False, logits_to_keep=1)  # warm-up
    if request == "forward":

        def run() -> None:
            with torch.no_grad():
                model_(input_ids=ids, use_cache=False, logits_to_keep=1)

    elif request == "gradient":
        model_.requires_grad_(False)

        def run() -> None:
            x = model_.get_input_embeddings()(ids).detach().requires_grad_(True)
            out = model_(inputs_embeds=x, use_cache=False, logits_to_keep=1)
            out.logits.float().logsumexp(-1).sum().backward()

    elif request == "patch":
        from heads.scorers.patching.activation import patch

        hm, pairs = HeadModel(model_, None, name=model), pair(None, tokens)

        def run() -> None:
            patch(hm, pairs, **PATCH_PLAN)

    else:
        hm = HeadModel(model_, tok, name=model)

        def run() -> None:
            sink_stats(hm, [text], chat=False, markup=False)

    cap(args.cap_gb)
    got = guarded(run, args.device)
    if "failed" in got:
        return got
    act = got["memory_mb"] * 2**20
    planned = plan.devices[0]
    return {
        "measured_mb": round((weights + act) / 2**20, 1),
        "planned_mb": round(planned.total / 2**20, 1),
        "measured_activation_mb": round(act / 2**20, 1),
        "planned_activation_mb": round(planned.activations / 2**20, 1),
        "error": round(abs(planned.total - (weights + act)) / (weights + act), 4),
        "activation_error": round(abs(planned.activations - act) / max(act, 1), 4),
    }


def plan_check(args, line: dict) -> None:
    cases = {}
    for model, dtype, request, tokens in PLAN_CASES:
        got = child(["--plan-one", model, dtype, request, str(tokens)], args)
        key = f"{model}_{dtype}_{request}_{tokens}"
        print(f"plan {key}: {got}", file=sys.stderr, flush=True)
        cases[key] = got
    plan_entries(line, cases)


# ------------------------------------------------------------------------------ Gemma-3-270m, long
def gemma_one(name: str, length: int, args) -> dict:
    import torch

    from heads import load_model

    hm = load_model("gemma-3-270m", device=args.device)
    ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(2))
    if name == "forward":

        def run() -> None:
            with torch.no_grad():
                hm.model(input_ids=ids, use_cache=False, logits_to_keep=1)

    elif name == "dla":
        from heads.scorers.patching.logit import direct_logit_attribution

        pairs = pair(hm, length)

        def run() -> None:
            direct_logit_attribution(hm, pairs)

    else:  # "atp": Ships' KL over 4 tokens (4 gradient flows); "atp-ld": one logit difference
        from heads.scorers.safety.attribution import attribute, logit_diff

        text = prompt(hm, length)  # at most `length` tokens as the prompt is encoded
        metric = logit_diff([ANSWERS[0]], [ANSWERS[1]]) if name == "atp-ld" else "kl"

        def run() -> None:
            attribute(hm, [text], ablation="sc", metric=metric, template=None)

    with torch.no_grad():
        hm.model(input_ids=ids[:, :128], use_cache=False, logits_to_keep=1)
    cap(args.cap_gb)
    got = guarded(run, args.device)
    got["load_average_1m"] = [round(os.getloadavg()[0], 2)]
    return got


def gemma(args, line: dict) -> None:
    line["gemma_lengths"] = args.gemma
    for name in ("forward", *args.gemma_analyses):
        for length in args.gemma:
            got = child(["--gemma-one", name, str(length)], args)
            print(f"gemma {name} {length}: {got}", file=sys.stderr, flush=True)
            gemma_entry(line, name, length, got)
