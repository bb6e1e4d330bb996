"""One command for a GPU machine: every device-specific test and benchmark, one JSON line.

    python benchmarks/gpu_check.py [--device cuda] [--dry-run]

Steps (each runs even when an earlier one failed; the line lists the failed ones and the exit
status is 1 if any failed):

* `tests`: the device-specific test files (`DEVICE_TESTS`: the fused kernel's equality tests,
  which move their tiny models to `HEADSTEER_TEST_DEVICE`, and the tests skipped without CUDA:
  offloaded caches, `device_map` splits) under pytest with `HEADSTEER_TEST_DEVICE=<device>`.
* `kernel`: the fused kernel (`heads.engine.kernels.fused.fused_attention`) against a plain
  softmax-attention oracle written here (GQA, a padded row, a column bias), forward and
  backward (the gradients of q, k, v), fp32 and bf16 (the dry run: fp32, forward only): largest
  absolute differences, refused beyond 1e-4 (fp32) / 5e-2 (bf16).
* `long_context`: on the embedded model, per prompt length, peak memory above the loaded model
  (`torch.cuda.max_memory_allocated` on CUDA) and median time of 3 (after one warm-up at that
  length) of a plain forward (`logits_to_keep=1`), PASTA on the fused kernel (3 heads in every
  layer), DLA and head-output patching of the last layer, each as a ratio over the plain
  forward at the same length, and the memory exponent (slope of log memory vs log length).
* `patching`: `patch(model, pairs, "head_out")` and `"head_out_by_pos"` on IOI pairs: cells per
  second and seconds over one plain forward of the same pairs.
* `eap_ig`: `edge_scores(model, pairs, method="eap-ig")` (5 steps) on the same pairs: edges
  per second and seconds over one forward + backward of the same pairs.
* `generation`: greedy generation unsteered vs PASTA (fused kernel) vs InstABoost: new tokens
  per second and the steered / unsteered time ratio (median of 3 after a warm-up).

On a GPU the whole check takes a few minutes (budget: 8; `seconds_total` says). Without CUDA and
without `--dry-run` it says so and exits 0. `--dry-run` runs every step on the CPU at a tiny size
(a random 3-layer model, 2 pairs, 32- and 64-token prompts; the tests are only collected, not
run): `tests/test_gpu_check.py` runs it in `make test`, so no step can go stale unnoticed.
flex_attention has no backward on the CPU in this torch, so the dry run's kernel step reports
the backward as not run, with torch's reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("tests", "kernel", "long_context", "patching", "eap_ig", "generation")
DEVICE_TESTS = ("tests/heads/test_fused.py", "tests/heads/test_caches.py", "tests/heads/test_device_map.py")
"""Every test file that reads `HEADSTEER_TEST_DEVICE` or runs only with CUDA
(`tests/test_gpu_check.py` fails when a test file outside this list does)."""


@dataclass(frozen=True)
class Sizes:
    lengths: tuple[int, ...]  # long_context prompt lengths
    pairs: int  # IOI pairs for patching / EAP-IG
    kernel_len: int  # kernel step sequence length
    prompt_tokens: int  # generation prompt
    new_tokens: int  # generation new tokens
    repeats: int  # timed runs (median)


FULL = Sizes(
    lengths=(1024, 2048, 4096, 8192), pairs=16, kernel_len=1000, prompt_tokens=256, new_tokens=64, repeats=3
)
DRY = Sizes(lengths=(32, 64), pairs=2, kernel_len=40, prompt_tokens=16, new_tokens=4, repeats=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """Peak memory in bytes above the start, over the `with` block: `torch.cuda.max_memory_allocated`
    on CUDA, else the resident set size sampled every 2 ms (indicative only: the allocator may
    keep freed memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.bytes = device, 0
        self._stop = threading.Event()

    def __enter__(self) -> Peak:
        _sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self._peak = _rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        _sync(self.device)
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.bytes = max(self._peak, _rss()) - self.base


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, int]:
    """(median seconds of `repeats` timed runs, the largest peak bytes among them); with
    `repeats` > 1 one untimed warm-up runs first (the dry run's single run is also its warm-up)."""
    if repeats > 1:
        fn()
    times, peaks = [], []
    for _ in range(repeats):
        with Peak(device) as peak:
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        peaks.append(peak.bytes)
    return statistics.median(times), max(peaks)


def _exponent(xs: list[float], ys: list[float]) -> float | None:
    """Slope of log(y) against log(x) (least squares); None without two positive points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / den, 3) if den else None


def _tiny_model(device: torch.device):
    """A random 3-layer Llama (GQA 4:2) with the embedded tokenizer, for the dry run."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from heads import HeadModel, load_tokenizer

    tok = load_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.08,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    return HeadModel(model.eval().to(device), tok, name="tiny-llama")


def _ioi_pairs(n: int):
    """`n` IOI pairs from `benchmarks/patching.py` (one template, ABC corruption)."""
    path = os.path.join(ROOT, "benchmarks", "patching.py")
    spec = importlib.util.spec_from_file_location("_patching_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ioi_pairs(n)


# ----------------------------------------------------------------------------------- steps


def step_tests(ctx: dict) -> dict:
    """The device tests under pytest; in the dry run each file is only resolved and compiled
    (`make test` runs them on the CPU anyway)."""
    paths = [os.path.join(ROOT, f) for f in DEVICE_TESTS]
    if ctx["dry_run"]:
        for p in paths:
            with open(p, encoding="utf-8") as f:
                compile(f.read(), p, "exec")
        return {"files": list(DEVICE_TESTS), "exit": 0, "summary": "resolved (dry run: not run)"}
    env = {**os.environ, "HEADSTEER_TEST_DEVICE": str(ctx["device"])}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *DEVICE_TESTS]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in r.stdout.strip().splitlines() if line.strip()]
    out = {"files": list(DEVICE_TESTS), "exit": r.returncode, "summary": lines[-1] if lines else ""}
    out["skipped"] = [line for line in lines if line.startswith("SKIPPED")]
    if r.returncode:
        out["error"] = (r.stdout + r.stderr)[-2000:]
    return out


def _oracle_attention(q, k, v, keep, bias, scale):
    """Plain softmax attention `[B, H, Q, d]` with GQA, a bool mask `keep` `[B, 1, Q, K]` and a
    column bias `[B, H, K]`, in fp32."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = q.float() @ k.transpose(-1, -2) * scale + bias[:, :, None, :]
    return s.masked_fill(~keep, -math.inf).softmax(-1) @ v


def step_kernel(ctx: dict) -> dict:
    from heads.engine.kernels.fused import fused_attention

    device, n = ctx["device"], ctx["sizes"].kernel_len
    out: dict = {"length": n}
    for dtype in (torch.float32,) if ctx["dry_run"] else (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, h, n, 16, generator=g) for h in (4, 2, 2))
        bias = torch.randn(2, 4, n, generator=g)
        keep = torch.ones(2, 1, n, n, dtype=torch.bool).tril()
        keep[1, :, :, : n // 4] = False  # row 1 left-padded by n / 4
        keep[1, :, : n // 4, 0] = True  # padded query rows see one key (no empty row)
        q, k, v, bias, keep = (x.to(device) for x in (q, k, v, bias, keep))
        q, k, v = (x.to(dtype).requires_grad_(device.type != "cpu") for x in (q, k, v))
        name = str(dtype).replace("torch.", "")
        ref = _oracle_attention(q, k, v, keep, bias, 0.25)
        with torch.no_grad():
            got = fused_attention(q, k, v, scale=0.25, mask=keep, bias=bias)
        out[f"forward_max_abs_diff_{name}"] = float((got.float() - ref.detach()).abs().max())
        if device.type == "cpu":  # torch's flex_attention refuses inputs that need a gradient there
            out[f"backward_{name}"] = "not run: flex_attention has no backward on the CPU"
            continue
        got = fused_attention(q, k, v, scale=0.25, mask=keep, bias=bias)
        w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(device)
        grads = torch.autograd.grad((got.float() * w).sum(), (q, k, v))
        refs = torch.autograd.grad((ref * w).sum(), (q, k, v))
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, refs, strict=True))
        out[f"backward_max_abs_diff_{name}"] = diff
    tol = {"float32": 1e-4, "bfloat16": 5e-2}
    bad = [key for key, val in out.items() if "max_abs_diff" in key and val > tol[key.rsplit("_", 1)[1]]]
    if bad:
        out["error"] = f"beyond tolerance {tol}: {bad}"
    return out


def _long_pair(model, n: int):
    from heads.scorers.patching import pairs_from_tokens

    g = torch.Generator().manual_seed(n)
    clean = torch.randint(100, model.d_vocab - 1, (n,), generator=g).tolist()
    corrupted = list(clean)
    corrupted[n - 4] = 99  # one token differs, near the end
    return pairs_from_tokens([clean], [corrupted], [clean[-1] + 1], [clean[-1]])


def _long_runs(model, n: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    """The long-context step's runs at length `n`: plain forward, PASTA (fused), DLA, patching."""
    from heads import SweepOptions, editing
    from heads.scorers.patching import direct_logit_attribution
    from heads.scorers.patching.activation import patch
    from steer.pasta.method import PastaBias

    g = torch.Generator().manual_seed(n)
    ids = torch.randint(100, model.d_vocab - 1, (1, n), generator=g).to(device)
    column = torch.full((1, n), math.log(0.01))
    column[:, n // 2 : n // 2 + max(1, n // 10)] = 0.0  # the emphasised span
    heads = list(range(min(3, model.n_heads)))
    edits = [PastaBias(layer=la, heads=heads, column_bias=column.to(device)) for la in range(model.n_layers)]
    pair = _long_pair(model, n)
    last = [model.n_layers - 1]

    @torch.no_grad()
    def forward() -> None:
        model.model(input_ids=ids, use_cache=False, logits_to_keep=1)

    @torch.no_grad()
    def pasta_fused() -> None:
        with editing(model, edits, kernel="fused"):
            model.model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return {
        "forward": forward,
        "pasta_fused": pasta_fused,
        "dla": lambda: direct_logit_attribution(model, pair),
        "patch_head_out_last_layer": lambda: patch(
            model, pair, "head_out", layers=last, options=SweepOptions(progress=False)
        ),
    }


def step_long_context(ctx: dict) -> dict:
    model, device, sizes = ctx["model"], ctx["device"], ctx["sizes"]
    res: dict[str, dict[int, tuple[float, int]]] = {}
    for n in sizes.lengths:
        for name, fn in _long_runs(model, n, device).items():
            try:
                res.setdefault(name, {})[n] = timed(fn, device, sizes.repeats)
            except torch.OutOfMemoryError:
                res.setdefault(name, {})[n] = (math.nan, -1)
                torch.cuda.empty_cache()
    out: dict = {"lengths": list(sizes.lengths)}
    base = res["forward"]
    for name, by_n in res.items():
        mb = [round(by_n[n][1] / 2**20, 1) if by_n[n][1] >= 0 else "oom" for n in sizes.lengths]
        out[f"memory_mb_{name}"] = mb
        out[f"seconds_{name}"] = [round(by_n[n][0], 4) if by_n[n][1] >= 0 else None for n in sizes.lengths]
        fits = [n for n in sizes.lengths if by_n[n][1] >= 0]
        ys = [float(by_n[n][1]) for n in fits]
        out[f"memory_exponent_{name}"] = _exponent([float(n) for n in fits], ys)
        if name != "forward":
            out[f"memory_ratio_{name}"] = [
                round(by_n[n][1] / base[n][1], 3) if by_n[n][1] >= 0 and base[n][1] > 0 else None
                for n in sizes.lengths
            ]
            out[f"time_ratio_{name}"] = [
                round(by_n[n][0] / base[n][0], 3) if by_n[n][1] >= 0 else None for n in sizes.lengths
            ]
    return out


def step_patching(ctx: dict) -> dict:
    from heads import SweepOptions
    from heads.scorers.patching import encode_pairs
    from heads.scorers.patching.activation import patch

    model, device, sizes = ctx["model"], ctx["device"], ctx["sizes"]
    pairs = encode_pairs(model, _ioi_pairs(sizes.pairs))
    ctx["pairs"] = pairs
    ids, mask = pairs.clean_ids.to(device), pairs.attention_mask.to(device)

    @torch.no_grad()
    def forward() -> None:
        model.model(input_ids=ids, attention_mask=mask, logits_to_keep=1)

    t_fwd, _ = timed(forward, device, sizes.repeats)
    out: dict = {"pairs": sizes.pairs, "tokens": int(pairs.clean_ids.shape[1]), "forward_s": round(t_fwd, 4)}
    opts = SweepOptions(progress=False)
    for kind in ("head_out", "head_out_by_pos"):
        t, _ = timed(lambda kind=kind: patch(model, pairs, kind, options=opts), device, sizes.repeats)
        cells = model.n_layers * model.n_heads * (pairs.clean_ids.shape[1] if kind.endswith("pos") else 1)
        out[f"{kind}_s"] = round(t, 4)
        out[f"{kind}_cells_per_s"] = round(cells / t, 1)
        out[f"{kind}_over_forward"] = round(t / t_fwd, 1)
    return out


def step_eap_ig(ctx: dict) -> dict:
    from heads import SweepOptions
    from heads.scorers.circuits.graph import graph_of
    from heads.scorers.circuits.scores import edge_scores
    from heads.scorers.patching import encode_pairs

    model, device, sizes = ctx["model"], ctx["device"], ctx["sizes"]
    pairs = ctx.get("pairs") or encode_pairs(model, _ioi_pairs(sizes.pairs))
    ids, mask = pairs.clean_ids.to(device), pairs.attention_mask.to(device)
    emb = model.model.get_input_embeddings()

    def forward_backward() -> None:
        x = emb(ids).detach().requires_grad_()
        out = model.model(inputs_embeds=x, attention_mask=mask, logits_to_keep=1)
        out.logits.float().sum().backward()
        model.model.zero_grad(set_to_none=True)

    t_fb, _ = timed(forward_backward, device, sizes.repeats)
    t, peak = timed(
        lambda: edge_scores(model, pairs, method="eap-ig", steps=5, options=SweepOptions(progress=False)),
        device,
        1,
    )
    n_edges = graph_of(model).n_edges
    return {
        "edges": n_edges,
        "steps": 5,
        "eap_ig_s": round(t, 4),
        "edges_per_s": round(n_edges / t, 1),
        "forward_backward_s": round(t_fb, 4),
        "eap_ig_over_forward_backward": round(t / t_fb, 1),
        "eap_ig_memory_mb": round(peak / 2**20, 1),
    }


def step_generation(ctx: dict) -> dict:
    from steer import InstaBoost, Pasta, SteeredModel

    model, device, sizes = ctx["model"], ctx["device"], ctx["sizes"]
    sm = SteeredModel(model)
    words = "the river runs past the old mill and the town sleeps under snow ".split()
    body = " ".join(words[i % len(words)] for i in range(sizes.prompt_tokens))
    prompt = f"Remember **the key is blue**. {body}"
    heads = {str(la): list(range(min(3, model.n_heads))) for la in range(model.n_layers)}
    steers: dict[str, list] = {"unsteered": [], "pasta": [Pasta(heads)], "instaboost": [InstaBoost()]}
    runs = {
        name: lambda steer=steer: sm.generate(
            prompt, steer=steer, max_new_tokens=sizes.new_tokens, chat=False
        )
        for name, steer in steers.items()
    }
    out: dict = {"prompt_tokens": int(sm.encode(prompt, chat=False).length), "new_tokens": sizes.new_tokens}
    base = None
    for name, fn in runs.items():
        t, _ = timed(fn, device, sizes.repeats)
        out[f"{name}_tokens_per_s"] = round(sizes.new_tokens / t, 1)
        if base is None:
            base = t
        else:
            out[f"time_ratio_{name}"] = round(t / base, 3)
    return out


STEP_FUNCTIONS: dict[str, Callable[[dict], dict]] = {
    "tests": step_tests,
    "kernel": step_kernel,
    "long_context": step_long_context,
    "patching": step_patching,
    "eap_ig": step_eap_ig,
    "generation": step_generation,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="every step on the CPU at a tiny size")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    elif not (args.device.startswith("cuda") and torch.cuda.is_available()):
        print("gpu_check: no CUDA device here; nothing to check (`--dry-run` runs every step on the CPU)")
        return 0
    device = torch.device(args.device)
    t0 = time.perf_counter()
    from heads import load_model

    model = _tiny_model(device) if args.dry_run else load_model(device=str(device))
    sizes = DRY if args.dry_run else FULL
    ctx: dict = {"device": device, "dry_run": args.dry_run, "model": model, "sizes": sizes}
    line: dict = {
        "benchmark": "gpu_check",
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": model.name,
        "torch": torch.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    failed = []
    for name in args.steps:
        t = time.perf_counter()
        try:
            res = STEP_FUNCTIONS[name](ctx)
        except Exception as e:  # a failed step is reported, the others still run
            res = {"error": f"{type(e).__name__}: {e}"[:2000]}
        res["seconds"] = round(time.perf_counter() - t, 1)
        if "error" in res:
            failed.append(name)
        print(f"gpu_check {name}: {res}", file=sys.stderr, flush=True)
        line[name] = res
    line["failed"] = failed
    line["seconds_total"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(line))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
