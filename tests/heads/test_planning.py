"""`heads.plan_memory` / `headsteer plan`: memory planned from a config alone.

Oracles: the published parameter counts of Llama-3.1-8B / 70B, Qwen2.5-7B and Gemma-2-9B (their
config values written here, from the models' `config.json`); the KV cache's closed form
(2 x KV heads x d_head x tokens x bytes per layer); the live bytes of a real forward of a tiny
model counted by the same tracker (the plan runs the family's code on fake tensors, so both must
agree); batch linearity; device splits that add up.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, Qwen2Config

from heads import SweepOptions
from heads.errors import HeadsteerValueError
from heads.planning import MemoryRequest, parse_bytes, plan_memory, rows_within
from heads.planning.trace import LiveBytes, traced_peak
from heads.scorers.safety.ships import ships

LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
LLAMA_31_70B = dict(
    LLAMA_31_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64
)
QWEN25_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=131072,
    rope_theta=1000000.0,
    sliding_window=131072,
    use_sliding_window=False,
    max_window_layers=28,
    tie_word_embeddings=False,
)
GEMMA2_9B = dict(
    vocab_size=256000,
    hidden_size=3584,
    intermediate_size=14336,
    num_hidden_layers=42,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    max_position_embeddings=8192,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    query_pre_attn_scalar=256,
)
PUBLISHED = [  # (config, parameters as the model cards / safetensors index give them)
    (LlamaConfig, LLAMA_31_8B, 8_030_261_248),
    (LlamaConfig, LLAMA_31_70B, 70_553_706_496),
    (Qwen2Config, QWEN25_7B, 7_615_616_512),
    (Gemma2Config, GEMMA2_9B, 9_241_705_984),
]


@pytest.mark.parametrize(
    ("cls", "values", "n_params"), PUBLISHED, ids=["llama8b", "llama70b", "qwen7b", "gemma9b"]
)
def test_published_configs_weights_and_kv_cache(cls, values, n_params):
    cfg = cls(**values)
    plan = plan_memory(cfg, "forward", 2048, dtype=torch.bfloat16)
    assert plan.devices[0].weights == pytest.approx(2 * n_params, rel=1e-3)
    assert plan.devices[0].layers == values["num_hidden_layers"]
    # a generation keeps 2 x G x d_head x tokens values per layer: one layer more adds exactly that
    kv = (
        2
        * values["num_key_value_heads"]
        * values.get("head_dim", values["hidden_size"] // values["num_attention_heads"])
    )
    tokens, new = 512, 64
    gen = MemoryRequest("generate", {"new_tokens": new, "kernel": "fused"})
    fewer = cls(**dict(values, num_hidden_layers=values["num_hidden_layers"] - 1))
    a = plan_memory(cfg, gen, tokens, dtype=torch.bfloat16).devices[0].activations
    b = plan_memory(fewer, gen, tokens, dtype=torch.bfloat16).devices[0].activations
    assert a - b == kv * (tokens + new) * 2  # bf16


def test_device_splits_add_up():
    cfg = LlamaConfig(**LLAMA_31_70B)
    one = plan_memory(cfg, "forward", 4096, dtype="bfloat16")
    four = plan_memory(cfg, "forward", 4096, dtype="bfloat16", devices=4)
    assert [d.device for d in four.devices] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [d.layers for d in four.devices] == [20, 20, 20, 20]
    assert sum(d.weights for d in four.devices) == one.devices[0].weights
    assert four.peak < one.peak / 3  # the weights are split, each device keeps the activations
    dmap = {"model.embed_tokens": "cuda:0", "model.norm": "cuda:1", "lm_head": "cuda:1"}
    dmap |= {f"model.layers.{i}": "cuda:0" if i < 30 else "cuda:1" for i in range(80)}
    mapped = plan_memory(cfg, "forward", 4096, dtype="bfloat16", devices=dmap)
    assert [d.layers for d in mapped.devices] == [30, 50]
    assert sum(d.weights for d in mapped.devices) == one.devices[0].weights
    with pytest.raises(HeadsteerValueError, match="places no device"):
        plan_memory(cfg, "forward", 64, devices={k: v for k, v in dmap.items() if k != "lm_head"})


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_vision_language_weights_include_the_vision_tower(kind):
    from tests.support.families import tiny_family_model

    hm = tiny_family_model(kind)
    real = sum(p.numel() * p.element_size() for p in hm.model.parameters())
    plan = plan_memory(hm.model.config, "forward", 32)
    assert plan.devices[0].weights == real
    two = plan_memory(hm.model.config, "forward", 32, devices=2)
    assert sum(d.weights for d in two.devices) == real
    assert sum(d.layers for d in two.devices) == plan.devices[0].layers


def test_batch_is_linear_and_gradient_keeps_each_layer():
    cfg = LlamaConfig(**dict(LLAMA_31_8B, num_hidden_layers=4))
    a1 = plan_memory(cfg, "forward", 1024, 1, torch.bfloat16).devices[0].activations
    a2 = plan_memory(cfg, "forward", 1024, 2, torch.bfloat16).devices[0].activations
    assert a2 == pytest.approx(2 * a1, rel=0.02)
    g4 = traced_peak(cfg, "backward", 256, 1, torch.float32)
    assert (
        g4.per_layer["layer"] > 0
        and traced_peak(cfg, "forward", 256, 1, torch.float32).per_layer["layer"] == 0
    )


def test_trace_equals_the_live_bytes_of_a_real_forward(tiny_llama):
    """The plan's activation part is the live-byte peak of the model's own forward on fake tensors:
    the same tracker on a real forward of the real (random) model gives the same count."""
    ids = torch.randint(10, 4000, (2, 96), generator=torch.Generator().manual_seed(0))
    tracker = LiveBytes()
    tracker.ignore(list(tiny_llama.model.parameters()) + list(tiny_llama.model.buffers()))
    with torch.no_grad(), tracker:
        tiny_llama.model(input_ids=ids, use_cache=False, logits_to_keep=1)
    plan = plan_memory(tiny_llama.model.config, "forward", 96, 2, torch.float32)
    assert plan.devices[0].activations == tracker.peak
    weights = sum(p.numel() * p.element_size() for p in tiny_llama.model.parameters())
    assert plan.devices[0].weights == weights


def test_pattern_readers_plan_within_15_percent_of_their_live_bytes(tokenizer):
    """The readers' closed form (K/V repeated per head, fp32 pattern blocks beside the layer's
    attention) against the live bytes of the real analyses on a random-weight model long enough
    for several query blocks: within the issue's +-15%; QRHead's default 64 query rows bound
    its real (shorter) query from above."""
    from transformers import AutoModelForCausalLM

    from heads import HeadModel
    from heads.scorers.retrieval.qrhead import qr_tokens
    from heads.scorers.roles.detectors import pattern_scores
    from heads.scorers.sinks import sink_stats
    from probes.datasets.needle import needle_task

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    hm = HeadModel(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval(), tokenizer, "t")
    task = needle_task(tokenizer, 512, seed=0)
    ids = torch.tensor([task.input_ids])
    from heads.engine.context import editing
    from heads.engine.knockout import KnockoutBias

    needle = torch.zeros(1, ids.shape[1], dtype=torch.bool)
    needle[0, slice(*task.needle)] = True

    def knockout() -> None:  # the needle's columns blocked from every row, every layer and head
        with editing(hm, [KnockoutBias(layer=la, keys=needle) for la in range(cfg.num_hidden_layers)]):
            hm.model(input_ids=ids, use_cache=False, logits_to_keep=1)

    runs = {
        "forward": lambda: hm.model(input_ids=ids, use_cache=False, logits_to_keep=1),
        "knockout": knockout,
        "sinks": lambda: sink_stats(hm, [task.text(tokenizer)], chat=False, markup=False),
        "detectors": lambda: pattern_scores(hm, ids),
        "qrhead": lambda: qr_tokens(hm, task.question, task.passages, chat=False),
    }
    planned, measured = {}, {}
    for name, run in runs.items():
        tracker = LiveBytes()
        tracker.ignore(list(hm.model.parameters()) + list(hm.model.buffers()))
        with torch.no_grad(), tracker:
            run()
        measured[name] = tracker.peak
        planned[name] = plan_memory(cfg, name, 512).devices[0].activations
    assert planned["forward"] == measured["forward"]
    for name in ("sinks", "detectors"):
        assert planned[name] > planned["forward"]  # 4 query blocks: the readers add to the peak
        assert abs(planned[name] - measured[name]) <= 0.15 * measured[name], (name, planned, measured)
    assert measured["qrhead"] <= planned["qrhead"] <= 2 * measured["qrhead"]
    # knockout's masks live beside the attention, below the MLP's peak here: within 15% of it
    # (the plan assumed 1,024-row pattern blocks per head: 4x the forward's activations)
    assert abs(planned["knockout"] - measured["knockout"]) <= 0.15 * measured["knockout"], (planned, measured)
    assert plan_memory(cfg, "gradient", 512).peak > plan_memory(cfg, "forward", 512).peak


def test_eap_plans_within_15_percent_of_their_live_bytes():
    """The `"eap"` / `"eap_lean"` closed forms (residual-stream copies kept beside a forward)
    against the live bytes of `eap_chunk` / `eap_chunk_lean` on a random-weight model."""
    from transformers import AutoModelForCausalLM

    from heads import HeadModel
    from heads.scorers.circuits import graph_of
    from heads.scorers.circuits.eap import eap_chunk
    from heads.scorers.circuits.eap_lean import eap_chunk_lean

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    hm = HeadModel(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval(), None, "t")
    T = 256
    clean = torch.randint(5, 1000, (1, T), generator=torch.Generator().manual_seed(1))
    corrupted = clean.clone()
    corrupted[0, T // 2] = 7

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, 3].sum() - logits[:, 4].sum()

    from heads.planning import plan as plan_module
    from heads.scorers.circuits import eap_lean

    assert eap_lean.BLOCK == plan_module.EAP_LEAN_BLOCK
    runs = (("eap", eap_chunk, None), ("eap_lean", eap_chunk_lean, None), ("eap_lean", eap_chunk_lean, 2))
    for name, run, steps in runs:  # EAP-IG on the lean path sweeps a third run
        tracker = LiveBytes()
        tracker.ignore(list(hm.model.parameters()) + list(hm.model.buffers()))
        with tracker:
            run(hm, graph_of(hm), clean, corrupted, torch.ones_like(clean), loss, steps=steps)
        planned = plan_memory(cfg, name, T).devices[0].activations
        assert abs(planned - tracker.peak) <= 0.15 * tracker.peak, (name, steps, planned, tracker.peak)
    assert plan_memory(cfg, "eap_lean", T).peak < plan_memory(cfg, "eap", T).peak


def test_budget_refused_with_the_minimum_named(tiny_llama, monkeypatch):
    need = plan_memory(tiny_llama, "forward", 64).peak
    with pytest.raises(HeadsteerValueError, match=r"needs at least .* max_memory is 1 KB"):
        rows_within(tiny_llama, "1KB", "forward", 64)
    two = plan_memory(tiny_llama, "forward", 64, 2).peak
    assert rows_within(tiny_llama, two, "forward", 64, most=64) == 2  # the budget of two rows
    assert plan_memory(tiny_llama, "forward", 64, 3).peak > two
    assert rows_within(tiny_llama, 10 * two, "forward", 64, most=5) == 5
    assert SweepOptions(max_memory=need).rows_for(tiny_llama, 64) == 1
    assert SweepOptions(max_rows=7).rows_for(tiny_llama, 64) == 7  # no budget: max_rows
    # a sweep given too small a budget is refused before any forward
    monkeypatch.setattr(tiny_llama, "run", lambda **kw: pytest.fail("a forward ran"))
    with pytest.raises(HeadsteerValueError, match="needs at least"):
        ships(tiny_llama, ["Hello there"], options=SweepOptions(max_memory="1KB"))


def test_bad_input():
    cfg = LlamaConfig(**dict(LLAMA_31_8B, num_hidden_layers=2))
    with pytest.raises(HeadsteerValueError, match="unknown analysis"):
        plan_memory(cfg, "dance", 64)
    with pytest.raises(HeadsteerValueError, match="takes no parameter"):
        plan_memory(cfg, MemoryRequest("sinks", {"new_tokens": 3}), 64)
    with pytest.raises(HeadsteerValueError, match="exceed the model's limit"):
        plan_memory(cfg, "forward", 200_000)
    with pytest.raises(HeadsteerValueError, match="tokens"):
        plan_memory(cfg, "forward", 0)
    for bad in ("lots", "-1GB", float("nan"), 0):
        with pytest.raises(HeadsteerValueError, match="max_memory"):
            parse_bytes(bad)
    assert parse_bytes("24GB") == 24 * 10**9 and parse_bytes("1.5 GiB") == 3 * 2**29
    with pytest.raises(TypeError, match="request must be"):
        plan_memory(cfg, 3, 64)


def test_cli_plans_from_the_config_alone(tiny_llama_dir, tmp_path):
    from typer.testing import CliRunner

    from tests.support.cli import one_line_error
    from viz.cli.main import app

    only_config = tmp_path / "config-only"
    only_config.mkdir()
    shutil.copy(f"{tiny_llama_dir}/config.json", only_config / "config.json")  # no weights at all
    model = ["--model", str(only_config), "--tokens", "128"]
    r = CliRunner().invoke(app, ["plan", *model, "--analysis", "sinks", "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["analysis"] == "sinks" and got["tokens"] == 128 and got["peak_bytes"] > 0
    one_line_error(
        CliRunner().invoke(app, ["plan", *model, "--max-memory", "1KB"]),
        "needs at least",
        ignore=("planning",),
    )
    one_line_error(
        CliRunner().invoke(app, ["plan", *model, "--analysis", "dance"]),
        "unknown analysis",
        ignore=("planning",),
    )
    # planning runs nothing on --device: a GPU named on a machine without one was refused
    r = CliRunner().invoke(app, ["plan", *model, "--device", "cuda", "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    assert [d["device"] for d in json.loads(r.stdout.strip().splitlines()[-1])["devices"]] == ["cuda"]
    one_line_error(CliRunner().invoke(app, ["plan", *model, "--device", "tpu"]), "use cpu, cuda")


def test_devices_configs_and_folders_are_checked_before_planning(tmp_path):
    """Device names torch parses, no more devices than layers, none twice, no disk; a config
    folder that leaves a size to transformers' defaults, a refused family and a missing folder
    are refused by name (none of them is planned)."""
    cfg = LlamaConfig(**dict(LLAMA_31_8B, num_hidden_layers=2))
    for bad, match in (
        ("tpu", "'tpu' is not a torch device"),
        (["cuda:0", "cuda:0"], "listed twice"),
        (3, "devices"),  # 3 GPUs for 2 layers
        (["cuda:0", "cuda:1", "cuda:2"], "3 devices for a model of 2 layers"),
        ([None, 3], "device names or GPU indices"),
        ({"model.layers.0": "disk"}, "'disk' is not planned"),
    ):
        with pytest.raises(HeadsteerValueError, match=match):
            plan_memory(cfg, "forward", 64, devices=bad)
    two = plan_memory(cfg, "forward", 64, devices=[0, 1])
    assert [d.device for d in two.devices] == ["cuda:0", "cuda:1"]
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(HeadsteerValueError, match="does not give num_hidden_layers"):
        plan_memory(bare, "forward", 64)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(
        json.dumps(
            {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
        )
    )
    with pytest.raises(HeadsteerValueError, match="'bert' is not supported"):
        plan_memory(bert, "forward", 64)
    with pytest.raises(HeadsteerValueError, match="no model folder at '/nonexistent/x'"):
        plan_memory("/nonexistent/x", "forward", 64)


def test_analysis_requests_plan_as_their_analysis_or_are_refused_by_name():
    from heads import CircuitRequest, KnockoutRequest, PatchRequest, SinkStatsRequest

    cfg = LlamaConfig(**dict(LLAMA_31_8B, num_hidden_layers=2))
    for request, analysis in (
        (KnockoutRequest(keys=[1]), "knockout"),
        (SinkStatsRequest(), "sinks"),
    ):
        assert plan_memory(cfg, request, 64).peak == plan_memory(cfg, analysis, 64).peak
    # find_circuit: the EAP scores and, after them, its exact evaluations of the circuit
    circuit = plan_memory(cfg, CircuitRequest(method="eap"), 64)
    assert circuit.request == MemoryRequest("eap", {"circuit": True})
    assert circuit.peak >= plan_memory(cfg, "eap", 64).peak
    assert plan_memory(cfg, PatchRequest(kind="head_out"), 64).request.analysis == "patch"
    with pytest.raises(HeadsteerValueError, match="method='exact'"):
        plan_memory(cfg, CircuitRequest(method="exact"), 64)


def test_a_device_map_key_with_odd_digits_is_no_layer_index():
    from heads.planning.devices import _layer_of

    assert _layer_of("model.layers.3.mlp") == 3
    assert _layer_of("model.layers.\u00b9.mlp") is None  # superscript one: str.isdigit() but not int()
    assert _layer_of("model.layers." + "9" * 5000 + ".mlp") is None


def test_fp32_moe_plans_within_15_percent_and_quietly(capfd):
    """fp32 MoE experts run through `_grouped_mm`, whose fake kernel takes bf16 only: the plan
    traces bf16 and doubles (it raised "cannot trace ... Expected inputs of BF16 type", and torch
    logged a traceback on stderr, so any `max_memory` budget on such a model failed)."""
    from tests.support.families import tiny_family_model

    m = tiny_family_model("qwen2_moe")
    ids = torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    planned = plan_memory(m, "forward", 12, 1).devices[0].activations
    assert "Traceback" not in capfd.readouterr().err
    tracker = LiveBytes()
    tracker.ignore(list(m.model.parameters()) + list(m.model.buffers()))
    with torch.no_grad(), tracker:
        m.model(input_ids=ids, use_cache=False, logits_to_keep=1)
    assert abs(planned - tracker.peak) <= 0.15 * tracker.peak, (planned, tracker.peak)
    assert SweepOptions(max_memory="10GB").within(m, 12).max_rows >= 1


def test_cli_plan_help_lists_every_analysis():
    """`headsteer plan --analysis`'s help names every analysis `plan_memory` knows (it had no
    `logits`; a new plan must be added there too)."""
    import typing

    from heads.planning import ANALYSES
    from viz.cli.plan import plan_command

    option = typing.get_type_hints(plan_command, include_extras=True)["analysis"].__metadata__[0]
    listed = {w.strip() for w in option.help.replace(" or ", ", ").split(",")}
    assert listed == set(ANALYSES)


def test_a_fractional_number_of_bytes_is_refused():
    """`max_memory=1.5` meant 1.5 of something, not 1 byte (it was truncated to 1 byte and the
    refusal named "1 B"); whole bytes and sizes with units are read as before."""
    with pytest.raises(HeadsteerValueError, match=r"max_memory 1.5 is a fractional number of bytes"):
        SweepOptions(max_memory=1.5)
    assert SweepOptions(max_memory=2.0e9).max_memory == 2_000_000_000
    assert parse_bytes("1.5GB") == 1_500_000_000
