"""QK attribution on the embedded model vs the route a user writes today on TransformerLens.

Work (the same for both routes, on one prompt of `--length` random tokens):

* **A**: every (query, key) cell of one head (`--head`, default 29.0: the most components): for
  every cell, each component's query-side and key-side marginal (`scale * a_i(q) . k(k)` and
  `scale * q(q) . b_j(k)`, float32, `[T, T, C + 1]` each) and the sum of terms;
* **B**: the last query of every head: the same per cell for the T cells of each of the 270 heads.

Routes:

* **ours**: `qk_attribution(model, ids, head, query=every position)` (A) and
  `qk_attributions(model, ids, query=-1)` (B), marginals from the results (`query_marginals`,
  `key_marginals`, float32);
* **cache route** (TransformerLens 4.3, `TransformerBridge` on the same weights, no weight
  processing): `run_with_cache`, the residual entering the layer from `hook_embed`,
  `stack_head_results` and `hook_mlp_out`, `apply_ln_to_stack` (the cached `ln1.hook_scale`, the
  frozen scale) times the norm's gain, each component through the head's `W_Q` / `W_K` with the
  rotary applied by hand (the cached `hook_cos` / `hook_sin`, rotate-half), the same marginals.

Figures (one JSON line, every ratio measured in this run): `speedup_vs_cache_route` (cache-route
CPU seconds over ours, A + B: the CPU time of each route's process, so the other jobs on a
shared machine stay out of the ratio; `speedup_wall_clock` beside it),
`memory_ratio_vs_cache_route` (our peak RSS above the loaded model over the cache route's), each
route's peak over a plain forward at the same length (`memory_ratio_vs_plain_forward_*`),
`max_abs_sum_error` (ours: largest |sum of terms - the model's own logit| over every cell of A
and B), `max_abs_diff_vs_cache_route` (largest difference of the marginals between the routes),
`cells` (A + B). Each route runs in a fresh subprocess (model loaded, one short warm-up forward,
then the timed work with RSS sampled every 2 ms).
The load average at the start is in the line: these machines are shared.

Usage: `python benchmarks/qk_attribution.py` (512 tokens; a few minutes on 2 CPU cores);
`--length 128` for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """Peak RSS above the level at entry, sampled every 2 ms on a thread."""

    def __enter__(self) -> _Peak:
        self.base = self.peak = _rss()
        self.done = threading.Event()
        self.t = threading.Thread(target=self._sample, daemon=True)
        self.t.start()
        self.t0 = time.perf_counter()
        self.c0 = time.process_time()
        return self

    def _sample(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0
        self.done.set()
        self.t.join()
        self.peak = max(self.peak, _rss())
        self.mb = (self.peak - self.base) / 2**20


def _ids(length: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, 40000, (1, length), generator=g)


def _ours(length: int, layer: int, head: int, out: str) -> dict:
    import torch

    from heads import load_model, qk_attribution
    from heads.scorers.qk import qk_attributions

    hm = load_model()
    ids = _ids(length)
    hm.model(input_ids=ids[:, :16])  # warm-up
    err = 0.0
    with torch.no_grad(), _Peak() as p:
        r = qk_attribution(hm, ids, (layer, head), query=list(range(length)))
        qa, ka = r.query_marginals(torch.float32), r.key_marginals(torch.float32)
        err = max(err, r.max_error())
        del r
        b = []
        for r in qk_attributions(hm, ids, None, query=-1):
            b.append((r.query_marginals(torch.float32)[0, 0], r.key_marginals(torch.float32)[0, 0]))
            err = max(err, r.max_error())
            del r
    torch.save({"qa": qa[0], "ka": ka[0], "b": b}, out)
    return {"seconds": p.seconds, "cpu": p.cpu, "memory_mb": p.mb, "max_abs_sum_error": err}


def _rot(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _cache_route(length: int, layer: int, head: int, out: str) -> dict:
    import torch

    from heads import load_model

    hm = load_model(backend="transformer_lens")
    bridge = hm.backend.native
    ids = _ids(length)
    bridge(ids[:, :16])  # warm-up
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    grp = H // bridge.W_K.shape[1]
    scale = hm.d_head**-0.5
    causal = torch.ones(length, length, dtype=torch.bool).tril()

    def sides(cache, la: int):
        """[C + 1, T, D] components of the residual entering `la`, normed (frozen scale, gain)."""
        comps = [cache["hook_embed"][0][None]]
        if la:
            heads = cache.stack_head_results(layer=la)[:, 0]  # [la * H, T, D]
            mlps = torch.stack([cache[f"blocks.{i}.hook_mlp_out"][0] for i in range(la)])
            for i in range(la):
                comps += [heads[i * H : (i + 1) * H], mlps[i : i + 1]]
        stack = torch.cat(comps)
        normed = cache.apply_ln_to_stack(stack, layer=la) * bridge.blocks[la].ln1.w
        return torch.cat([normed, torch.zeros_like(normed[:1])])  # the constant ("bias"): none here

    def project(normed, la: int, h: int, cos, sin):
        q = _rot(normed @ bridge.W_Q[la, h], cos, sin)  # [C + 1, T, d]
        k = _rot(normed @ bridge.W_K[la, h // grp], cos, sin)
        return q, k

    with torch.no_grad(), _Peak() as p:
        _, cache = bridge.run_with_cache(ids)
        cos, sin = cache[f"blocks.{layer}.attn.hook_cos"][0], cache[f"blocks.{layer}.attn.hook_sin"][0]
        normed = sides(cache, layer)
        q, k = project(normed, layer, head, cos, sin)
        qt, kt = q.sum(0), k.sum(0)
        qa = torch.einsum("cqd,kd->qkc", q, kt) * scale * causal[..., None]
        ka = torch.einsum("qd,ckd->qkc", qt, k) * scale * causal[..., None]
        del q, k, normed
        b = []
        for la in range(L):
            normed = sides(cache, la)
            cos, sin = cache[f"blocks.{la}.attn.hook_cos"][0], cache[f"blocks.{la}.attn.hook_sin"][0]
            for h in range(H):
                q, k = project(normed, la, h, cos, sin)
                q = q[:, -1]  # [C + 1, d] the last query
                b.append(
                    (
                        torch.einsum("cd,kd->kc", q, k.sum(0)) * scale,
                        torch.einsum("d,ckd->kc", q.sum(0), k) * scale,
                    )
                )
            del normed
        del cache
    torch.save({"qa": qa, "ka": ka, "b": b}, out)
    return {"seconds": p.seconds, "cpu": p.cpu, "memory_mb": p.mb}


def _plain(length: int) -> dict:
    import torch

    from heads import load_model

    hm = load_model()
    ids = _ids(length)
    hm.model(input_ids=ids[:, :16])
    with torch.no_grad(), _Peak() as p:
        hm.model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return {"seconds": p.seconds, "cpu": p.cpu, "memory_mb": p.mb}


def _child(route: str, length: int, layer: int, head: int, out: str) -> dict:
    cmd = [sys.executable, __file__, "--child", route, "--length", str(length), "--head", f"{layer}.{head}"]
    cmd += ["--out", out]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode:
        raise RuntimeError(f"{route} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--head", default="29.0", help="L.H of part A (default 29.0)")
    ap.add_argument("--child", choices=("ours", "cache", "plain"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    layer, head = (int(x) for x in args.head.split("."))
    if args.child:
        fn = {"ours": _ours, "cache": _cache_route}.get(args.child)
        res = _plain(args.length) if fn is None else fn(args.length, layer, head, args.out)
        print(json.dumps(res))
        return
    import torch

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        plain = _child("plain", args.length, layer, head, os.path.join(tmp, "p.pt"))
        ours = _child("ours", args.length, layer, head, os.path.join(tmp, "ours.pt"))
        tl = _child("cache", args.length, layer, head, os.path.join(tmp, "tl.pt"))
        a, b = torch.load(os.path.join(tmp, "ours.pt")), torch.load(os.path.join(tmp, "tl.pt"))
    diff = max(
        float((a["qa"].nan_to_num() - b["qa"]).abs().max()),
        float((a["ka"].nan_to_num() - b["ka"]).abs().max()),
        max(float((x - y).abs().max()) for (x, _), (y, _) in zip(a["b"], b["b"], strict=True)),
        max(float((x - y).abs().max()) for (_, x), (_, y) in zip(a["b"], b["b"], strict=True)),
    )
    T = args.length
    line = {
        "benchmark": "qk_attribution",
        "model": "SmolLM2-135M-Instruct",
        "length": T,
        "head_a": f"L{layer}H{head}",
        "cells": T * (T + 1) // 2 + len(a["b"]) * T,
        "speedup_vs_cache_route": round(tl["cpu"] / ours["cpu"], 3),
        "speedup_wall_clock": round(tl["seconds"] / ours["seconds"], 3),
        "memory_ratio_vs_cache_route": round(ours["memory_mb"] / tl["memory_mb"], 3),
        "max_abs_sum_error": ours["max_abs_sum_error"],
        "max_abs_diff_vs_cache_route": diff,
        "cpu_seconds_ours": round(ours["cpu"], 2),
        "cpu_seconds_cache_route": round(tl["cpu"], 2),
        "wall_seconds_ours": round(ours["seconds"], 2),
        "wall_seconds_cache_route": round(tl["seconds"], 2),
        "clock": "CPU seconds of each route's process (time.process_time): other jobs on the shared "
        "machine do not enter the ratio; the wall-clock ratio beside it",
        "memory_mb_ours": round(ours["memory_mb"], 1),
        "memory_mb_cache_route": round(tl["memory_mb"], 1),
        "memory_ratio_vs_plain_forward_ours": round(ours["memory_mb"] / max(plain["memory_mb"], 1e-6), 2),
        "memory_ratio_vs_plain_forward_cache_route": round(
            tl["memory_mb"] / max(plain["memory_mb"], 1e-6), 2
        ),
        "memory_measure": "RSS peak above the loaded model",
        "load_average": round(load, 2),
        "device": "cpu",
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
