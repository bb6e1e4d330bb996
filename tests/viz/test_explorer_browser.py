"""The head explorer in a real browser: Playwright driving Debian's Chromium (`/usr/bin/chromium`).

Screenshots of every view are written to a temporary folder whose path is printed
(`pytest -s` shows it). Tiny random model, except the demo-prompt test (`real`).
"""

import shutil
import socket
import threading
from pathlib import Path

import pytest

from tests.support.waiting import wait_until
from viz.explorer import create_explorer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")
PROMPT = "Ignore this. **Remember the word apple** and say something"


def serve(app):
    """Start `app` on a free loopback port in a thread; return (url, stop)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "the explorer's uvicorn starts")
    assert server.started, "uvicorn stopped before it started"

    def stop():
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}/", stop


@pytest.fixture(scope="module")
def served(model):
    """(url, app) of one explorer on the tiny model, shared by the module's tests."""
    app = create_explorer(model)
    address, stop = serve(app)
    yield address, app
    stop()


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("explorer-screenshots")
    print(f"\nexplorer screenshots: {d}")
    return d


def open_page(browser, url):
    """A fresh tab (own browser context: nothing shared) with its console errors collected."""
    page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
    # waits, not timings: on a loaded 2-core machine a click's forward can queue behind the
    # page's own prepare and head-card forwards (the speed is measured in benchmarks/explorer.py)
    page.set_default_timeout(90_000)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=90_000)
    return page, errors


def click_cell(page, target: str, layer: int, head: int, n_layers: int, n_heads: int) -> None:
    """Click cell (layer, head) of a Plotly heatmap (layer 0 at the bottom)."""
    box = page.locator(f"#{target} .nsewdrag").first.bounding_box()
    x = box["x"] + (head + 0.5) / n_heads * box["width"]
    y = box["y"] + (1 - (layer + 0.5) / n_layers) * box["height"]
    page.mouse.click(x, y)


def set_heads(page, heads, alpha):
    page.evaluate("([h, a]) => { state.heads = h; headsText(); document.getElementById('param').value = a; }",
                  [heads, alpha])  # fmt: skip


def expected_text(model, prompt, heads, alpha, n):
    from steer.pasta.method import Pasta
    from steer.steered_model import SteeredModel

    by_layer: dict[int, list[int]] = {}
    for la, h in heads:
        by_layer.setdefault(la, []).append(h)
    return (
        SteeredModel(model)
        .generate(prompt, [Pasta(heads=by_layer, alpha=alpha)], max_new_tokens=n, progress=False)
        .text
    )


def test_load_click_pattern_and_bad_prompt(browser, url, model, shots):
    from heads.scorers.attention_mass import head_pattern

    page, errors = open_page(browser, url)
    assert page.locator("#grid .heatmaplayer").count() == 1  # the overview grid is drawn
    assert page.locator("#error").inner_text() == ""
    page.locator("#overview").screenshot(path=str(shots / "overview.png"))
    # every head's pattern recorded for the page's prompt at load
    page.wait_for_function("window.__explorer.preparedPrompt === document.getElementById('prompt').value")
    click_cell(page, "grid", 1, 2, model.n_layers, model.n_heads)
    page.wait_for_selector("#pattern[data-head='1,2']", timeout=90_000)
    assert page.evaluate("performance.getEntriesByName('click-to-pattern').length") == 1
    _, tokens, _ = head_pattern(model, PROMPT, 1, 2)
    ticks = page.locator("#pattern .xtick text").all_text_contents()
    assert ticks and all(t.split(":", 1)[0].isdigit() for t in ticks) and len(ticks) <= len(tokens)
    page.wait_for_selector("#head-card[data-head='1,2']", timeout=90_000)
    assert "logit lens" in page.locator("#head-card").inner_text()
    # looking is not selecting: the click showed the head, the steered heads are unchanged
    assert page.locator("#heads").inner_text() == "(none)"
    page.click("#btn-steer-head")  # the card's button selects it ...
    assert page.locator("#heads").inner_text() == "L1H2"
    assert page.evaluate("document.getElementById('grid').data[2].x") == [2]  # circled on the grid
    assert page.locator("#btn-steer-head").inner_text() == "stop steering this head"
    page.click("#btn-steer-head")  # ... and unselects it
    assert page.locator("#heads").inner_text() == "(none)"
    page.locator("#head-view").screenshot(path=str(shots / "head.png"))
    # a bad prompt: one line in the page, and the next request works
    page.fill("#prompt", "")
    page.click("#btn-score")
    page.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "prompt" in page.locator("#error").inner_text()
    page.fill("#prompt", PROMPT)
    page.click("#btn-score")
    page.wait_for_function("document.getElementById('error').textContent === '' && state.jobs.size === 0")
    assert page.locator("#grid .heatmaplayer").count() == 1
    # a prompt over the limit: one line on a click, then the next click works
    page.fill("#prompt", "x" * 4001)
    click_cell(page, "grid", 0, 0, model.n_layers, model.n_heads)
    page.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "limit" in page.locator("#error").inner_text() and "\n" not in page.locator("#error").inner_text()
    # markup in the prompt is drawn as text in the pattern's labels, never as page elements
    page.fill("#prompt", "**a** <b>x</b><img src=y onerror=alert(1)>")
    click_cell(page, "grid", 0, 1, model.n_layers, model.n_heads)
    page.wait_for_selector("#pattern[data-head='0,1']", timeout=90_000)
    assert page.locator("#error").inner_text() == ""
    assert page.locator("#pattern img, #pattern b").count() == 0
    labels = page.evaluate("document.getElementById('pattern').data[0].x.join(' ')")
    assert "&lt;" in labels and "<" not in labels  # escaped for Plotly, which decodes entities
    assert not [e for e in errors if "400" not in e], errors  # only the refused request's own log line
    # two clicks in quick succession (no wait: Plotly's hover lags the pointer): each picks its own
    # cell, and the pattern shown is the last click's even if the first one's answer comes later
    page.fill("#prompt", PROMPT)
    click_cell(page, "grid", 2, 0, model.n_layers, model.n_heads)
    click_cell(page, "grid", 2, 3, model.n_layers, model.n_heads)
    page.wait_for_selector("#head-card[data-head='2,3']")
    assert page.locator("#pattern").get_attribute("data-head") == "2,3"
    assert page.locator("#heads").inner_text() == "(none)"
    # shift-click selects a head without looking at it
    page.keyboard.down("Shift")
    click_cell(page, "grid", 0, 1, model.n_layers, model.n_heads)
    page.keyboard.up("Shift")
    page.wait_for_function("document.getElementById('heads').textContent === 'L0H1'")
    assert page.locator("#pattern").get_attribute("data-head") == "2,3"


def test_two_tabs_steer_differently_and_cancel(browser, served, model, shots):
    """Two tabs generate at the same time with different heads; each gets its own answer."""
    from heads.scorers.attention_mass import span_attention

    url, app = served
    n = 6
    all_heads = [[la, h] for la in range(model.n_layers) for h in range(model.n_heads)]
    one_layer = [[0, h] for h in range(model.n_heads)]
    a, errors_a = open_page(browser, url)
    b, errors_b = open_page(browser, url)
    for page, heads, alpha in ((a, all_heads, 1e-4), (b, one_layer, 0.5)):
        set_heads(page, heads, alpha)
        page.fill("#prompt", PROMPT)
        page.fill("#max-new", str(n))
    a.click("#btn-generate")
    b.click("#btn-generate")
    for page in (a, b):
        page.wait_for_selector("#out-steered[data-done='1']", timeout=60_000)
    got_a, got_b = a.locator("#out-steered").inner_text(), b.locator("#out-steered").inner_text()
    assert got_a.strip() == expected_text(model, PROMPT, all_heads, 1e-4, n).strip()
    assert got_b.strip() == expected_text(model, PROMPT, one_layer, 0.5, n).strip()
    assert got_a != got_b
    assert a.locator("#heads").inner_text() != b.locator("#heads").inner_text()
    # the span share per layer, unsteered and steered, drawn after the run
    a.wait_for_selector("#span-share[data-done='1']", timeout=90_000)
    drawn = a.evaluate("document.getElementById('span-share').data.map((t) => t.y)")
    want_before = span_attention(model, PROMPT).scores.mean(1).tolist()
    assert len(drawn) == 2 and drawn[0] == pytest.approx(want_before, abs=1e-4)
    assert all(s > u for u, s in zip(*drawn, strict=True))  # PASTA on every head raises the span share
    a.locator("#steering").screenshot(path=str(shots / "steering.png"))
    # cancel: a generation that cannot end on its own (the model is busy: the test holds its
    # lock) stops, the page says so, its slot is freed, and the next one works
    jobs, lock = app.state.jobs, app.state.explorer.lock
    # a tab's prepare (sent when its prompt stopped changing) may still wait for the model on a
    # loaded machine: let every job end first, so the slot count below is the cancelled job's
    wait_until(lambda: jobs.running() == 0, "both tabs' jobs end before the cancel case")
    a.fill("#max-new", "250")
    with lock:
        a.click("#btn-generate")
        a.wait_for_function(
            "document.getElementById('status').textContent.startsWith('waiting for the model')"
        )
        ids = a.evaluate("Array.from(state.jobs.keys())")  # the page's id of the waiting job
        assert len(ids) == 1, ids
        a.click("#btn-cancel")
        a.wait_for_function("document.getElementById('error').textContent === 'cancelled'", timeout=90_000)
        a.wait_for_function("state.jobs.size === 0")
        # `cancel` answers False once no job of that id runs: its slot is free (other jobs, such
        # as a tab's prepare sent meanwhile, may still wait for the model)
        wait_until(
            lambda: not jobs.cancel(ids[0]), "the cancelled job frees its slot while the model is busy"
        )
    wait_until(lambda: jobs.running() == 0, "every job ends once the model is free")
    done = [a.locator(f"#{o}").get_attribute("data-done") for o in ("out-plain", "out-steered")]
    assert done == [None, None] and a.locator("#out-plain").inner_text() == ""  # it never ran
    a.fill("#max-new", "2")
    a.click("#btn-generate")
    a.wait_for_selector("#out-steered[data-done='1']", timeout=90_000)
    assert a.locator("#error").inner_text() == ""
    assert not errors_a and not errors_b, (errors_a, errors_b)


def test_method_picker_runs_spotlight(browser, url, model):
    """Picking SpotLight in the panel: its parameter box, no heads sent, and the text
    `SteeredModel.generate` gives with `Spotlight(tau)`."""
    from steer import Spotlight
    from steer.steered_model import SteeredModel

    page, errors = open_page(browser, url)
    page.select_option("#method", "spotlight")
    assert page.locator("#param-name").inner_text() == "tau"
    assert page.locator("#steered-title").inner_text() == "Steered (SpotLight)"
    page.evaluate("state.heads = [[0, 0]]; headsText();")  # clicked heads are not sent to SpotLight
    page.fill("#param", "0.6")
    page.fill("#prompt", PROMPT)
    page.fill("#max-new", "6")
    page.click("#btn-generate")
    page.wait_for_selector("#out-steered[data-done='1']", timeout=60_000)
    want = SteeredModel(model).generate(PROMPT, [Spotlight(tau=0.6)], max_new_tokens=6, progress=False)
    assert page.locator("#out-steered").inner_text().strip() == want.texts[0].strip()
    assert page.locator("#out-steered").inner_text() != page.locator("#out-plain").inner_text()
    page.select_option("#method", "act")
    assert (
        page.locator("#param-name").inner_text() == "beta" and page.locator("#param").input_value() == "0.4"
    )
    assert page.locator("#error").inner_text() == "" and not errors, errors


def test_patching_view_clicks_through(browser, url, model, shots):
    page, errors = open_page(browser, url)
    page.fill("#clean", "The cat sat on the mat")
    page.fill("#corrupted", "The dog sat on the mat")
    page.fill("#answer", " and")
    page.fill("#counterfactual", "")
    page.click("#btn-patch")
    page.wait_for_selector("#patch-pos[data-done='1']", timeout=60_000)
    assert "log_prob" in page.locator("#patch-info").inner_text()
    pos = page.evaluate("document.getElementById('patch-pos').data[0]")
    assert len(pos["z"]) == model.n_layers and len(pos["x"]) == len(pos["z"][0])
    assert "cat" in " ".join(pos["x"])
    page.locator("#patching").screenshot(path=str(shots / "patching.png"))
    # the score picker offers the patching map: the overview grid is coloured by it
    page.select_option("#score", "patching")
    page.wait_for_function("state.grid.score === 'patching'")
    heads_map = page.evaluate("document.getElementById('patch-grid').data[0].z")
    assert page.evaluate("document.getElementById('grid').data[0].z") == heads_map
    click_cell(page, "patch-grid", 0, 1, model.n_layers, model.n_heads)
    page.wait_for_selector("#pattern[data-head='0,1']", timeout=90_000)
    labels = page.evaluate("document.getElementById('pattern').data[0].x.join(' ')")
    assert "cat" in labels and "dog" not in labels  # the pattern on the clean prompt
    assert not errors, errors


def test_picking_dla_recolours_the_grid(browser, url, model):
    """The score menu's `dla`: the grid is redrawn with the library's per-head direct logits of
    the top next token (`head_logits`), on a diverging scale, and the hover names the score."""
    from heads.engine.forward import forward
    from heads.inputs.prompts import encode_prompts
    from heads.scorers.patching.logit import head_logits
    from heads.scorers.patching.pairs import PromptPair, encode_pairs

    page, errors = open_page(browser, url)
    before = page.evaluate("document.getElementById('grid').data[0].z")
    page.select_option("#score", "dla")
    page.wait_for_function("state.grid.score === 'dla' && state.jobs.size === 0")
    trace = page.evaluate(
        "(() => { const t = document.getElementById('grid').data[0];"
        " return { z: t.z, zmid: t.zmid, text: t.text[1][2] }; })()"
    )
    text = encode_prompts(model.tokenizer, page.input_value("#prompt")).texts[0]  # the page's demo prompt
    logits = forward(model, encode_prompts(model.tokenizer, text, chat=False, markup=False))[0, -1]
    top, second = logits.topk(2).indices.tolist()
    want = head_logits(model, encode_pairs(model, [PromptPair(text, text, top, second)]))[0][0]
    assert trace["z"] != before
    assert trace["z"] == [[pytest.approx(v, abs=1e-5) for v in row] for row in want.tolist()]
    assert trace["zmid"] == 0 and "dla score" in trace["text"]
    assert page.locator("#error").inner_text() == "" and not errors, errors


@pytest.mark.real
def test_demo_prompt_steered_differs_on_embedded_model(browser, smol, shots):
    """The demo prompt with the shipped PASTA heads: the steered text is not the unsteered one."""
    address, stop = serve(create_explorer(smol))
    try:
        page, errors = open_page(browser, address)
        page.click("#btn-shipped")
        assert page.locator("#heads").inner_text() != "(none)"
        page.fill("#max-new", "12")
        page.click("#btn-generate")
        page.wait_for_selector("#out-steered[data-done='1']", timeout=120_000)
        plain, steered = page.locator("#out-plain").inner_text(), page.locator("#out-steered").inner_text()
        assert plain.strip() and steered.strip() and plain != steered
        page.screenshot(path=str(shots / "embedded.png"), full_page=True)
        assert not errors, errors
    finally:
        stop()


def test_raw_text_switch_and_every_token_labelled(browser, url, model, tokenizer):
    """The raw-text switch (off by default on a model with a chat template) sends the prompt as
    it is: the pattern's tokens are `head_pattern(..., chat=False)`'s; "label every token" labels
    each of a long prompt's tokens, which the default axis thins out."""
    from heads.scorers.attention_mass import head_pattern

    page, errors = open_page(browser, url)
    assert page.is_checked("#raw") is False
    long = " ".join(f"word{i}" for i in range(40))
    page.fill("#prompt", long)
    click_cell(page, "grid", 1, 0, model.n_layers, model.n_heads)
    page.wait_for_selector("#pattern[data-head='1,0']")
    chat_tokens = head_pattern(model, long, 1, 0)[1]
    assert page.evaluate("state.pattern.tokens") == chat_tokens  # with the template
    page.check("#raw")
    page.evaluate("document.getElementById('pattern').removeAttribute('data-head')")
    click_cell(page, "grid", 1, 0, model.n_layers, model.n_heads)
    page.wait_for_selector("#pattern[data-head='1,0']")
    raw_tokens = head_pattern(model, long, 1, 0, chat=False)[1]
    assert page.evaluate("state.pattern.tokens") == raw_tokens and len(raw_tokens) < len(chat_tokens)
    shown = page.locator("#pattern .xtick text").all_text_contents()
    assert len(shown) < len(raw_tokens)  # the default axis thins a long prompt's labels
    page.check("#all-ticks")
    page.wait_for_selector("#pattern[data-ticks='all']")
    shown = page.locator("#pattern .xtick text").all_text_contents()
    assert shown == [f"{i}:{t}" for i, t in enumerate(raw_tokens)]
    assert page.locator("#pattern .ytick text").count() == len(raw_tokens)
    assert page.locator("#error").inner_text() == "" and not errors, errors


def test_a_base_model_defaults_to_raw_text(browser, model, tokenizer):
    """A tokenizer without a chat template (a base model): the switch starts on."""
    import copy

    from heads import HeadModel

    base_tok = copy.deepcopy(tokenizer)
    base_tok.chat_template = None
    address, stop = serve(create_explorer(HeadModel(model.model, base_tok, name="tiny-base")))
    try:
        page, errors = open_page(browser, address)
        assert page.is_checked("#raw") is True and page.is_checked("#patch-raw") is True
        assert not errors, errors
    finally:
        stop()


def test_typing_never_piles_prepares_up(browser, served, monkeypatch):
    """The page sends a prepare after every pause in typing; while the model is busy, each new
    one cancels the previous (the page aborts it and the server supersedes it), so only the last
    prompt is recorded once the model is free (found by a breaker: 120 abandoned prepares
    delayed a generation by minutes)."""
    from viz.explorer import patterns

    url, app = served
    page, errors = open_page(browser, url)
    jobs, lock = app.state.jobs, app.state.explorer.lock
    recorded: list[str] = []
    real = patterns.all_patterns
    monkeypatch.setattr(patterns, "all_patterns", lambda m, p, **k: recorded.append(p) or real(m, p, **k))
    starts: list[str] = []
    real_start = jobs.start
    monkeypatch.setattr(jobs, "start", lambda j: starts.append(j) or real_start(j))
    prompts = [f"{PROMPT} draft {i}" for i in range(4)]
    with lock:  # the model is busy: every prepare waits
        for i, p in enumerate(prompts):
            page.fill("#prompt", p)
            wait_until(lambda i=i: len(starts) == i + 1, "the page sent its prepare")
            wait_until(lambda: jobs.running() == 1, "the previous prepare is cancelled, one waits")
    wait_until(lambda: jobs.running() == 0, "the last prepare ran")
    page.wait_for_function(f"window.__explorer.preparedPrompt === {prompts[-1]!r}")
    assert recorded == [prompts[-1]]  # the superseded drafts never ran the model
    assert not errors, errors


def test_clicking_a_pattern_cell_shows_its_qk_attribution(browser, url, model, shots):
    from heads import encode_prompts, qk_attribution

    page, errors = open_page(browser, url)
    page.wait_for_function("window.__explorer.preparedPrompt === document.getElementById('prompt').value")
    click_cell(page, "grid", 2, 1, model.n_layers, model.n_heads)
    page.wait_for_selector("#pattern[data-head='2,1']", timeout=90_000)
    n = len(page.evaluate("document.getElementById('pattern').data[0].x"))
    query, key = n - 1, 3
    # cell (query, key) of the pattern: row `query` (y reversed: the first row on top), column `key`
    box = page.locator("#pattern .nsewdrag").first.bounding_box()
    page.mouse.click(box["x"] + (key + 0.5) / n * box["width"], box["y"] + (query + 0.5) / n * box["height"])
    page.wait_for_selector(f"#qk-view[data-cell='{query},{key}']", timeout=90_000)
    prompt = page.input_value("#prompt")
    assert not page.is_checked("#raw")
    enc = encode_prompts(model.tokenizer, prompt)  # the page's default: the chat template
    r = qk_attribution(model, enc, (2, 1), query=query, keys=[key], by="source_token")
    want = r.top_pairs(1)[0]
    bars = page.evaluate("document.getElementById('qk-pairs').data[0]")
    assert bars["x"][-1] == pytest.approx(want[2], abs=1e-4)  # the largest term drawn on top
    assert bars["y"][-1] == f"{want[0]} · {want[1]}"
    assert len(page.evaluate("document.getElementById('qk-table').data[0].z")) >= 2
    assert "read" in page.locator("#qk-view table").inner_text()
    page.locator("#head-view").screenshot(path=str(shots / "qk.png"))
    assert not errors, errors
