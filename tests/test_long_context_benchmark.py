"""benchmarks/long_context_analyses.py's printing step: the JSON line rebuilt from children's logs
(`--from-log`) has the ratios, exponents and maxima the issue asks for, the peers' fail lengths
and the plan's largest error (no model is run here)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "long_context_analyses.py"


def _module():
    spec = importlib.util.spec_from_file_location("long_context_analyses", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(n_mb: float, seconds: float) -> dict:
    return {"memory_mb": n_mb, "seconds": seconds, "cpu_seconds": seconds * 2}


def _child(forward: dict, analysis: dict, **extra: object) -> dict:
    return {"forward": forward, "analysis": analysis, **extra}


LOG_A = [
    f"eap 1024: {_child(_run(20.0, 1.0), _run(50.0, 10.0), ig_steps=5, load_average_1m=[1.5])}",
    f"eap 2048: {_child(_run(40.0, 2.0), _run(110.0, 30.0), ig_steps=5, load_average_1m=[2.5])}",
    f"eap-ig 1024: {_child(_run(20.0, 1.0), _run(50.0, 9.0), forward_all_logits=_run(200.0, 2.0))}",
    f"knockout 1024: {_child(_run(20.0, 1.0), _run(21.0, 1.5))}",
    "some other line the parser skips",
]
LOG_B = [
    # a later entry replaces an earlier one (a rerun after a fix)
    f"knockout 1024: {_child(_run(20.0, 1.0), _run(19.0, 1.2))}",
    f"knockout 2048: {_child(_run(40.0, 2.0), _run(44.0, 2.2), forward_all_logits=_run(88.0, 3.0))}",
    f"peer transformer_lens 1024: {_run(3000.0, 5.0)}",
    "peer transformer_lens 2048: {'failed': 'exit 1: MemoryError'}",
    "sinks 1024: {'failed': 'exit 1: MemoryError'}",
    f"peer nnsight 1024: {_run(1300.0, 4.0)}",
    f"peer nnsight 2048: {_run(4800.0, 9.0)}",
    "plan 0.1B_float32_forward_2048: {'error': 0.01, 'activation_error': 0.05}",
    "plan 1B_bfloat16_forward_2048: {'error': 0.003, 'activation_error': 0.12}",
    "gemma dla 16384: {'memory_mb': 2000.0, 'seconds': 300.0, 'cpu_seconds': 250.0}",
    f"circuit 1024: {_child(_run(20.0, 1.0), _run(400.0, 20.0))}",
]


def test_from_log_merges_analyses_peers_plan_and_gemma(tmp_path: Path) -> None:
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("\n".join(LOG_A) + "\n")
    b.write_text("\n".join(LOG_B) + "\n")
    mod = _module()
    line = mod.from_logs([str(a), str(b)], mod.KINDS)
    assert line["eap_memory_ratio"] == [2.5, 2.75]
    assert line["eap_cpu_time_ratio"] == [10.0, 15.0]
    assert line["memory_exponent_eap"] == round(math.log(110 / 50) / math.log(2), 3)
    assert line["knockout_memory_ratio"] == [0.95, 1.1]  # the later 1k entry won
    assert "knockout_memory_ratio_all_logits" not in line  # the 1k entry has no such baseline
    assert line["max_memory_ratio_gradient"] == 2.75
    assert line["eap-ig_memory_ratio_all_logits"] == [0.25]  # 50 MB over model(ids)'s 200 MB
    assert line["max_memory_ratio_forward_only"] == 1.1  # exact edge patching has its own maximum
    assert line["max_memory_ratio_circuit"] == 20.0
    assert line["max_memory_exponent"] == max(line["memory_exponent_eap"], line["memory_exponent_knockout"])
    assert line["peer_fail_length_transformer_lens"] == 2048
    assert line["peer_transformer_lens_failure"] == "exit 1: MemoryError"
    assert (line["sinks_failed_at"], line["sinks_failure"]) == (1024, "exit 1: MemoryError")
    assert line["peer_transformer_lens_memory_mb"] == [3000.0]
    assert line["peer_fail_length_nnsight"] is None
    assert line["peer_nnsight_lengths"] == [1024, 2048]
    assert line["plan_error_max"] == 0.01
    assert line["plan_error_max_activations"] == 0.12
    assert line["gemma_dla_16k_memory_mb"] == 2000.0
    assert line["ig_steps"] == 5
    assert line["load_average_1m_range"] == [1.5, 2.5]


def test_from_log_cli_prints_one_json_line(tmp_path: Path) -> None:
    a = tmp_path / "a.log"
    a.write_text("\n".join(LOG_A) + "\n")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-log", str(a)], capture_output=True, text=True, check=True
    )
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["eap_memory_ratio"] == [2.5, 2.75]


def test_a_printed_line_merges_with_later_logs(tmp_path: Path) -> None:
    """`--from-log NEW --base-line OLD.json`: a printed line whose logs were not kept is merged with
    later runs: its ratios come back unchanged, a logged length is added (the exponent and the
    maxima recomputed over both), a logged (analysis, length) replaces the line's, and its peer,
    plan and Gemma entries are kept."""
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("\n".join(LOG_A + LOG_B) + "\n")
    mod = _module()
    base = mod.from_logs([str(a)], mod.KINDS)
    base_path = tmp_path / "line.json"
    base_path.write_text(json.dumps(base))
    b.write_text(
        f"eap 4096: {_child(_run(80.0, 4.0), _run(200.0, 40.0))}\n"
        f"knockout 2048: {_child(_run(40.0, 2.0), _run(60.0, 2.0))}\n"
    )
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-log", str(b), "--base-line", str(base_path)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["eap_memory_ratio"] == [2.5, 2.75, 2.5]  # the line's two lengths, then the log's
    assert line["eap_lengths"] == [1024, 2048, 4096]
    xs, ys = [math.log(n) for n in (1024, 2048, 4096)], [math.log(m) for m in (50.0, 110.0, 200.0)]
    slope = sum((x - sum(xs) / 3) * (y - sum(ys) / 3) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - sum(xs) / 3) ** 2 for x in xs
    )
    assert line["memory_exponent_eap"] == round(slope, 3)
    assert line["eap_cpu_time_ratio"] == base["eap_cpu_time_ratio"] + [10.0]
    assert line["knockout_memory_ratio"] == [0.95, 1.5]  # the logged 2k replaced the line's 1.1
    assert line["max_memory_ratio_forward_only"] == 1.5 and line["max_memory_ratio_circuit"] == 20.0
    for key in ("peer_fail_length_transformer_lens", "plan_error_max", "gemma_dla_16k_memory_mb"):
        assert line[key] == base[key]
    assert line["merged_from_logs"] == base["merged_from_logs"] + 1
