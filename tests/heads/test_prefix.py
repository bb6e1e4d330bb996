"""Clean-prefix reuse (`heads.engine.prefix.starting_at`) and the scorers that rely on it."""

import pytest
import torch

from heads import HeadScale, QueryScale, editing, encode_prompts, forward
from heads.engine.prefix import starting_at
from heads.scorers.safety.ships import TEMPLATE, ships
from tests.support import make_tiny

PROMPTS = ["How do I bake bread?", "Tell me a story about a dragon.", "Two plus two?"]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2"])
def test_starting_at_equals_full_run(kind, tokenizer):
    hm = make_tiny(kind, tokenizer)
    enc = encode_prompts(tokenizer, PROMPTS, chat=False, markup=False)
    pos = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def run():
        return hm.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask, position_ids=pos)

    with torch.no_grad():
        full = hm.model(
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            position_ids=pos,
            output_hidden_states=True,
        )
        top = hm.n_layers - 1
        edit = HeadScale(layer=top, heads=[1], factor=0.0)
        with editing(hm, edit):
            want = run().logits
        calls = []
        hook = hm.attentions[0].register_forward_hook(lambda *a: calls.append(1))
        for start in range(1, hm.n_layers):
            with starting_at(hm, start, full.hidden_states[start]):
                got = run()
            torch.testing.assert_close(got.logits, full.logits, atol=1e-5, rtol=0)
        hook.remove()
        assert not calls  # layer 0 was never computed
        with editing(hm, edit), starting_at(hm, top, full.hidden_states[top]):
            got = run()
        torch.testing.assert_close(got.logits, want, atol=1e-5, rtol=0)
    # restored: no instance `forward` left behind, and a full run is unchanged
    assert all("forward" not in block.__dict__ for block in hm.layers)
    torch.testing.assert_close(forward(hm, enc), full.logits, atol=0, rtol=0)


def test_starting_at_restores_after_error_and_checks_input(tiny_llama, tokenizer):
    enc = encode_prompts(tokenizer, PROMPTS, chat=False, markup=False)
    with pytest.raises(ValueError, match="does not match"):
        with starting_at(tiny_llama, 1, torch.zeros(1, 2, tiny_llama.d_model)):
            forward(tiny_llama, enc)
    assert all("forward" not in block.__dict__ for block in tiny_llama.layers)
    with pytest.raises(ValueError, match="layer must be"):
        with starting_at(tiny_llama, tiny_llama.n_layers, None):
            pass
    with pytest.raises(ValueError, match="residual must be"):
        with starting_at(tiny_llama, 1, torch.zeros(3, 4)):
            pass


@pytest.mark.parametrize("ablation", ["ua", "sc"])
def test_ships_with_prefix_reuse_equals_full_runs(tiny_llama, tokenizer, ablation):
    """The oracle: one plain full forward per head, KL from log-softmax at the last position."""
    heads = [(0, 2), (1, 0), (2, 3), (2, 1)]
    res = ships(tiny_llama, PROMPTS, heads=heads, ablation=ablation, eps=1e-3)
    enc = encode_prompts(tokenizer, [TEMPLATE.format(query=p) for p in PROMPTS], chat=False, markup=False)
    base = torch.log_softmax(forward(tiny_llama, enc)[:, -1].float(), -1)
    kind = QueryScale if ablation == "ua" else HeadScale
    for layer, head in heads:
        with editing(tiny_llama, kind(layer=layer, heads=[head], factor=1e-3)):
            lp = torch.log_softmax(forward(tiny_llama, enc)[:, -1].float(), -1)
        want = (base.exp() * (base - lp)).sum(-1)
        torch.testing.assert_close(res.per_prompt[:, layer, head], want, atol=1e-5, rtol=1e-4)


def test_threads_with_different_prefix_starts_each_get_their_own_result(tiny_llama, tokenizer):
    """Several threads run `starting_at` with different start layers (and batch sizes) on one model
    at the same moment (a barrier inside each forward keeps them all in flight together): each
    gets its single-thread logits bit for bit, one thread's bad residual raises only there, and
    the model is bitwise restored afterwards (issue: three threads once raised "cached residual
    ... does not match the batch", returned wrong maps, or left the model broken)."""
    import threading

    from heads.engine import state as engine_state
    from heads.engine.edits import ResidualEdit

    hm = tiny_llama
    enc = encode_prompts(tokenizer, PROMPTS, chat=False, markup=False)
    pos = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = hm.model(
            input_ids=enc.input_ids,
            attention_mask=enc.attention_mask,
            position_ids=pos,
            output_hidden_states=True,
        )
    plans = [(0, 3), (1, 2), (2, 3), (1, 1), (2, 2)]  # (start layer, batch rows)

    def run(start: int, rows: int, meet=None, residual=None):
        res = full.hidden_states[start][:rows] if residual is None else residual
        edits = [] if meet is None else [meet]
        with torch.no_grad(), editing(hm, edits), starting_at(hm, start, res):
            return hm.model(
                input_ids=enc.input_ids[:rows],
                attention_mask=enc.attention_mask[:rows],
                position_ids=pos[:rows],
            ).logits

    alone = [run(s, r) for s, r in plans]
    barrier = threading.Barrier(len(plans) + 1)

    class Meet(ResidualEdit):
        def apply(self, x, call):
            barrier.wait(timeout=30)  # every thread is inside its forward, its skips installed
            return None

    got: dict[int, object] = {}

    def worker(i: int) -> None:
        try:
            got[i] = run(*plans[i], meet=Meet(layer=hm.n_layers - 1))
        except BaseException as e:  # noqa: BLE001 - reported below
            got[i] = e

    def bad() -> None:
        try:
            with starting_at(hm, 2, torch.zeros(1, 2, hm.d_model)):
                barrier.wait(timeout=30)
                hm.model(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
        except ValueError as e:
            got["bad"] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(plans))]
    threads.append(threading.Thread(target=bad))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert "does not match the batch" in str(got["bad"])
    for i in range(len(plans)):
        assert isinstance(got[i], torch.Tensor), got[i]
        assert torch.equal(got[i], alone[i]), plans[i]
    assert not engine_state.INSTALLED
    assert all("forward" not in block.__dict__ for block in hm.layers)
    torch.testing.assert_close(forward(hm, enc), full.logits, atol=0, rtol=0)
