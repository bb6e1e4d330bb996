"""The head explorer in headless Chromium (Playwright) on the embedded model, CPU.

Figures (one JSON line):
* `click_to_pattern_ms`: a mouse click on a grid cell (the click event's `timeStamp`) to the
  head's `[T, T]` pattern drawn (`Plotly.react` resolved; `performance.now()`, also recorded as
  the `click-to-pattern` performance measure), for a 256-token prompt; the median of `--clicks`
  clicks on different heads, the first click included (`click_to_pattern_all_ms` lists all);
  `click_to_data_ms` the part up to the pattern's JSON parsed (the rest is Plotly drawing).
  What is warm: the page is loaded and its grid drawn, and the page's own `/api/prepare` for
  the prompt (sent 0.5 s after the prompt stops changing: one forward recording every head's
  pattern for this tab) has returned, as it has for a user who clicks a head after typing.
  No click on that prompt has been made before the first timed one.
* `pattern_forward_ms`: the baseline in the same run, `head_pattern` (one forward for one head,
  what each click cost before the cache) timed in Python on the same prompt while the server is
  up and idle, median of `--clicks`; `click_vs_forward` = `click_to_pattern_ms / pattern_forward_ms`.
* `click_uncached_ms`: the same click on a prompt the server has not prepared (a new prompt per
  click, the page's delayed prepare cancelled): the click's own request records the prompt's
  patterns first (one forward over every head), then answers; `click_uncached_vs_forward` is
  it over `pattern_forward_ms`. This is what a click costs before the prepare has returned.
* `first_token_ratio`: time to the first streamed token of a steered generation in the page
  (request sent to the first `text` event, browser clock) over the time to the first token of
  `SteeredModel.generate` itself (call to the streamer's first text) with the same prompt, heads
  and alpha; medians of `--runs` runs each, after one untimed warm-up run of each, the two
  interleaved while the server is up (so both see the same machine state).
* `page_kb`: bytes the page loads (HTML + plotly.min.js, decoded) / 1024; `page_kb_transferred`
  the bytes on the wire (browser resource timing `transferSize`: plotly is sent gzipped).

Long prompts (`--long 2048,8192`: only this case, its own JSON line, `"benchmark":
"explorer_long"`), per length `T` (a plain-text prompt of exactly `T` tokens, `raw` on), in the
page as a user clicks:
* `click_uncached_ms`: a click on a head of a prompt the server has not prepared (the page's
  delayed prepare cancelled): the click's request records the overview of every head and the
  residuals (one forward reducing every pattern block by block) and answers; click to the
  overview drawn.
* `click_cached_ms`: clicks on other heads of that prompt (the overview is kept): click to the
  overview drawn (`Plotly.react` of the `[G, G]` grid and the `[T]` statistics resolved),
  median of `--clicks`.
* `window_cached_ms`: clicks on the overview, each opening the exact 64 x 64 window around the
  block clicked (one layer run from its kept residual, stopped once the rows are read): click
  to the window drawn, median of `--clicks`.
* the baseline in the same run, `forward_ms`: one plain forward of the model on the same prompt
  (the last position's logits only, as the overview's forward; timed in Python while the server
  is idle, median of 2), and each figure's ratio to it
  (`*_vs_forward`); `goal_ms` (300) and whether the cached clicks meet it at the longest length.
The head card is answered by a stub in this case (its logit-lens forward is not part of the
pattern view, and it would hold the model while the next click waits). `--long-api 8192` times
the same requests through the HTTP API in process, without a browser (request to JSON parsed:
no drawing), names ending in `_api_ms`.

Usage: `nice python benchmarks/explorer.py [--screenshot docs/img/explorer.png]` (about a minute);
`nice python benchmarks/explorer.py --long 2048,8192` (minutes: the uncached click at 8k tokens
records every head's overview).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.viz.test_explorer_browser import click_cell, serve  # noqa: E402

DEMO = "Answer in French. **The capital of France is** the city of"


def long_prompt(tokenizer, n: int = 256) -> str:
    """A prompt of about `n` tokens after the chat template, with a marked span."""
    filler = "The quick brown fox jumps over the lazy dog near the river bank. "
    words = filler * 40
    ids = tokenizer(words)["input_ids"]
    body = tokenizer.decode(ids[: n - 60])
    return f"{body} **The capital of France is** the city of"


def sdk_first_token(sm, prompt, steer, n: int) -> float:
    from transformers import TextStreamer

    class First(TextStreamer):
        t = None

        def on_finalized_text(self, text, stream_end=False):
            if text and self.t is None:
                self.t = time.perf_counter()

    s = First(sm.model.tokenizer, skip_prompt=True, skip_special_tokens=True)
    t0 = time.perf_counter()
    sm.generate(prompt, steer, max_new_tokens=n, progress=False, streamer=s)
    return (s.t - t0) * 1000


def heads_by_layer(pairs: list[list[int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for la, h in pairs:
        out.setdefault(la, []).append(h)
    return out


def exact_prompt(tokenizer, n: int) -> str:
    """A plain-text prompt of exactly `n` tokens (corpus-like filler, no chat template)."""
    from heads.inputs.prompts import encode_prompts

    filler = "The quick brown fox jumps over the lazy dog near the river bank, then rests. "
    ids = tokenizer(filler * (n // 8 + 10))["input_ids"]
    for k in range(n, n - 20, -1):  # decoding may merge a token at the cut
        text = tokenizer.decode(ids[:k])
        if encode_prompts(tokenizer, text, chat=False).length == n:
            return text
    raise RuntimeError(f"no prompt of exactly {n} tokens")


CARD_STUB = '{"layer": 0, "head": 0, "lens_tokens": [], "model_tokens": [], "maps": [], "scores": {}}'


def long_case(model, lengths: list[int], clicks: int) -> dict:
    """The long-prompt figures (module docstring) at each length, in Chromium."""
    from playwright.sync_api import sync_playwright

    from heads.engine.forward import forward
    from heads.inputs.prompts import encode_prompts
    from viz.explorer import create_explorer

    url, stop = serve(create_explorer(model))
    out: dict = {"benchmark": "explorer_long", "model": model.name, "goal_ms": 300, "lengths": {}}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(3_600_000)  # the uncached click at 8k: minutes on a loaded machine
            errors: list[str] = []  # a page fault fails the run instead of leaving it waiting
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route(
                "**/api/head", lambda route: route.fulfill(content_type="application/json", body=CARD_STUB)
            )
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']")
            page.check("#raw")
            for n in lengths:
                prompt = exact_prompt(model.tokenizer, n)
                enc = encode_prompts(model.tokenizer, prompt, chat=False)
                page.fill("#prompt", prompt)
                page.evaluate("clearTimeout(prepareTimer)")  # uncached: the click records the overview
                page.evaluate("(() => { const e = document.getElementById('pattern'); "
                              "delete e.dataset.head; delete e.dataset.view; })()")  # fmt: skip

                def head_click(layer: int, head: int, timeout: float = 3_600_000) -> float:
                    click_cell(page, "grid", layer, head, model.n_layers, model.n_heads)
                    page.wait_for_selector(
                        f"#pattern[data-head='{layer},{head}'][data-view='overview']", timeout=timeout
                    )
                    return float(page.evaluate("window.__explorer.lastPatternMs"))

                cold = head_click(1, 1)
                cached = [
                    head_click((3 + 5 * i) % model.n_layers, (2 + 2 * i) % model.n_heads, timeout=300_000)
                    for i in range(clicks)
                ]
                windows = []
                for i in range(clicks):
                    page.evaluate("delete document.getElementById('pattern-window').dataset.window")
                    box = page.locator("#pattern .nsewdrag").first.bounding_box()
                    fx, fy = 0.15 + 0.1 * i, 0.9 - 0.05 * i  # below the diagonal: attended cells
                    page.mouse.click(box["x"] + fx * box["width"], box["y"] + fy * box["height"])
                    page.wait_for_selector("#pattern-window[data-window]", timeout=300_000)  # drawn: visible
                    windows.append(float(page.evaluate("window.__explorer.lastWindowMs")))
                forward_ms = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    forward(model, enc, logits_to_keep=1)  # as the overview's forward: no [T, V] logits
                    forward_ms.append((time.perf_counter() - t0) * 1000)
                base = statistics.median(forward_ms)
                fig = _long_figures(base, cold, cached, windows, "")
                assert not errors, errors
                out["lengths"][str(n)] = fig
                print(json.dumps({"length": n, **fig}), file=sys.stderr, flush=True)
            browser.close()
    finally:
        stop()
    last = out["lengths"][str(max(lengths))]
    out["goal_met_at_longest"] = max(last["click_cached_ms"], last["window_cached_ms"]) <= 300
    return out


def long_api_case(model, n: int, clicks: int) -> dict:
    """The long-prompt figures at `n` tokens through the HTTP API in process (FastAPI's
    `TestClient`: routing, the job, JSON encoding; no browser, so no drawing): request sent to
    JSON parsed. Same figures and baseline as `long_case`, names ending in `_api_ms`."""
    from fastapi.testclient import TestClient

    from heads.engine.forward import forward
    from heads.inputs.prompts import encode_prompts
    from viz.explorer import create_explorer

    client = TestClient(create_explorer(model))
    prompt = exact_prompt(model.tokenizer, n)
    body = {"prompt": prompt, "raw": True, "tab": "bench-long-api"}

    def timed(extra: dict) -> float:
        t0 = time.perf_counter()
        r = client.post("/api/pattern", json={**body, **extra})
        r.json()
        assert r.status_code == 200, r.text[:300]
        return (time.perf_counter() - t0) * 1000

    cold = timed({"layer": 1, "head": 1})
    cached = [
        timed({"layer": (3 + 5 * i) % model.n_layers, "head": (2 + 2 * i) % model.n_heads})
        for i in range(clicks)
    ]
    windows = []
    for i in range(clicks):
        q0 = int((0.9 - 0.05 * i) * n) - 32
        k0 = int((0.15 + 0.1 * i) * n) - 32
        windows.append(
            timed(
                {
                    "layer": (7 * i + 4) % model.n_layers,
                    "head": i,
                    "q0": q0,
                    "q1": q0 + 64,
                    "k0": k0,
                    "k1": k0 + 64,
                }
            )
        )
    enc = encode_prompts(model.tokenizer, prompt, chat=False)
    t0 = time.perf_counter()
    forward(model, enc, logits_to_keep=1)
    base = (time.perf_counter() - t0) * 1000
    return {"length": n, **_long_figures(base, cold, cached, windows, "_api")}


def _long_figures(
    base: float, cold: float, cached: list[float], windows: list[float], via: str
) -> dict[str, object]:
    """One long-prompt line's figures (ms, and ratios over the forward `base`); `via` is `""` for
    the page, `"_api"` for the HTTP API (the timed keys carry it)."""
    return {
        "forward_ms": round(base, 1),
        f"click_uncached{via}_ms": round(cold, 1),
        f"click_cached{via}_ms": round(statistics.median(cached), 1),
        f"click_cached{via}_all_ms": [round(t, 1) for t in cached],
        f"window_cached{via}_ms": round(statistics.median(windows), 1),
        f"window_cached{via}_all_ms": [round(t, 1) for t in windows],
        "click_uncached_vs_forward": round(cold / base, 3),
        "click_cached_vs_forward": round(statistics.median(cached) / base, 4),
        "window_cached_vs_forward": round(statistics.median(windows) / base, 4),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clicks", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--screenshot", default=None, help="write a screenshot of the page here")
    ap.add_argument(
        "--long", default=None, help="prompt lengths of the long-prompt case only, e.g. 2048,8192"
    )
    ap.add_argument(
        "--long-api", default=None, help="the long case through the API only (no browser), e.g. 8192"
    )
    args = ap.parse_args()
    if args.long_api:
        from heads import load_model

        m = load_model()
        figs = [long_api_case(m, int(x), min(args.clicks, 3)) for x in args.long_api.split(",")]
        print(
            json.dumps({"benchmark": "explorer_long_api", "model": m.name, "goal_ms": 300, "lengths": figs})
        )
        return
    if args.long:
        from heads import load_model

        lengths = [int(x) for x in args.long.split(",")]
        print(json.dumps(long_case(load_model(), lengths, min(args.clicks, 3))))
        return

    from playwright.sync_api import sync_playwright

    from heads import load_model
    from heads.inputs.prompts import encode_prompts
    from heads.scorers.attention_mass import head_pattern
    from steer.pasta.method import Pasta
    from steer.steered_model import SteeredModel
    from viz.explorer import create_explorer
    from viz.explorer.state import shipped_heads as _shipped_heads

    model = load_model()
    url, stop = serve(create_explorer(model))
    prompt = long_prompt(model.tokenizer)
    n_tokens = int(encode_prompts(model.tokenizer, prompt).attention_mask.sum())
    shipped = _shipped_heads(model.name)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            sizes: list[int] = []
            page.on("response", lambda r: sizes.append(len(r.body())) if r.request.method == "GET" else None)
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']", timeout=120_000)
            page_kb = sum(sizes) / 1024
            wire_kb = page.evaluate(
                "(performance.getEntriesByType('navigation')[0].transferSize + performance"
                ".getEntriesByType('resource').filter((e) => e.name.endsWith('.js'))"
                ".reduce((a, e) => a + e.transferSize, 0)) / 1024"
            )
            page.fill("#prompt", prompt)  # the input event: the page prepares the prompt
            page.wait_for_function(
                "(p) => window.__explorer.preparedPrompt === p", arg=prompt, timeout=600_000
            )
            times, fetched = [], []
            for i in range(args.clicks):
                layer, head = (3 + 5 * i) % model.n_layers, (1 + 2 * i) % model.n_heads
                click_cell(page, "grid", layer, head, model.n_layers, model.n_heads)
                page.wait_for_selector(f"#pattern[data-head='{layer},{head}']", timeout=120_000)
                times.append(page.evaluate("window.__explorer.lastPatternMs"))
                fetched.append(page.evaluate("window.__explorer.lastPatternFetchMs"))
                page.wait_for_selector(f"#head-card[data-head='{layer},{head}']", timeout=600_000)
            # uncached clicks: a prompt the server has not seen, the page's delayed prepare
            # cancelled, so the click's own request records the prompt's patterns first
            cold = []
            for i in range(args.clicks):
                page.fill("#prompt", f"{prompt} {i}")
                page.evaluate("clearTimeout(prepareTimer)")
                layer, head = (4 + 5 * i) % model.n_layers, (2 + 2 * i) % model.n_heads
                click_cell(page, "grid", layer, head, model.n_layers, model.n_heads)
                page.wait_for_selector(f"#pattern[data-head='{layer},{head}']", timeout=600_000)
                cold.append(page.evaluate("window.__explorer.lastPatternMs"))
                page.wait_for_selector(f"#head-card[data-head='{layer},{head}']", timeout=600_000)
            page.fill("#prompt", DEMO)
            page.evaluate("(h) => { state.heads = h; headsText(); }", shipped)  # the clicked heads out
            page.fill("#max-new", "4")
            # the baselines, timed while the server is up and idle, interleaved with the page's
            # runs so that both see the same machine; each side warmed once first (untimed)
            sm = SteeredModel(model)
            steer = [Pasta(heads=heads_by_layer(shipped), alpha=0.01)]
            sdk_first_token(sm, DEMO, steer, 4)
            web: list[float] = []
            sdk: list[float] = []
            for i in range(args.runs + 1):
                page.click("#btn-generate")
                page.wait_for_selector("#out-steered[data-done='1']", timeout=120_000)
                if i:  # run 0 warms the page's path
                    web.append(page.evaluate("window.__explorer.firstTokenMs"))
                    sdk.append(sdk_first_token(sm, DEMO, steer, 4))
            forward_ms = []
            for i in range(args.clicks):
                t0 = time.perf_counter()
                head_pattern(model, prompt, (3 + 5 * i) % model.n_layers, (1 + 2 * i) % model.n_heads)
                forward_ms.append((time.perf_counter() - t0) * 1000)
            if args.screenshot:  # the demo prompt: a head's pattern and card, a steered run
                layer, head = shipped[0] if shipped else (0, 0)
                click_cell(page, "grid", layer, head, model.n_layers, model.n_heads)
                page.wait_for_selector(f"#head-card[data-head='{layer},{head}']", timeout=600_000)
                page.fill("#max-new", "24")
                page.click("#btn-shipped")
                page.click("#btn-generate")
                page.wait_for_selector("#span-share[data-done='1']", timeout=300_000)
                page.wait_for_selector("#out-steered[data-done='1']", timeout=300_000)
                page.screenshot(path=args.screenshot, full_page=True)
                print(f"wrote {args.screenshot}", file=sys.stderr)
            browser.close()
    finally:
        stop()
    out = {
        "benchmark": "explorer",
        "model": model.name,
        "prompt_tokens": n_tokens,
        "click_to_pattern_ms": round(statistics.median(times), 1),
        "click_to_pattern_all_ms": [round(t, 1) for t in times],
        "click_to_data_ms": round(statistics.median(fetched), 1),
        "pattern_forward_ms": round(statistics.median(forward_ms), 1),
        "click_vs_forward": round(statistics.median(times) / statistics.median(forward_ms), 3),
        "click_uncached_ms": round(statistics.median(cold), 1),
        "click_uncached_all_ms": [round(t, 1) for t in cold],
        "click_uncached_vs_forward": round(statistics.median(cold) / statistics.median(forward_ms), 3),
        "first_token_ms_page": round(statistics.median(web), 1),
        "first_token_ms_sdk": round(statistics.median(sdk), 1),
        "first_token_ratio": round(statistics.median(web) / statistics.median(sdk), 3),
        "page_kb": round(page_kb, 1),
        "page_kb_transferred": round(wire_kb, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
