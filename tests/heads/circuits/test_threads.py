"""`find_circuit`, `ships` and `attribute` from three threads on one model give their
single-thread results, and the model is restored after them (no hook, no instance `forward`
left, the same logits bit for bit). Before the analyses ran on the engine's per-thread edits,
`find_circuit(method="eap")` raised a raw torch RuntimeError in 8 of 9 such calls."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from heads.inputs.prompts import position_ids
from heads.scorers.circuits import find_circuit
from heads.scorers.patching import pairs_from_tokens
from heads.scorers.safety.attribution import attribute
from heads.scorers.safety.ships import ships
from tests.support import make_tiny

QUERIES = ["Paris is the capital of", "The sky is"]


def _pairs(seed: int):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(10, 3000, (2, 6), generator=g).tolist()
    corr = [list(r) for r in clean]
    for r in corr:
        r[1] = int(torch.randint(10, 3000, (1,), generator=g))
    return pairs_from_tokens(clean, corr, [5, 6], [40, 41])


def _hooks(model) -> int:
    """Hooks and instance `forward`s on the model's modules, but `transformers`' own permanent
    output-capturing hooks (installed on a model's first `output_hidden_states` forward)."""

    def ours(fn) -> bool:
        return not getattr(fn, "__module__", "").startswith("transformers.")

    n = 0
    for m in model.model.modules():
        hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
        n += sum(map(ours, hooks)) + ("forward" in vars(m))
    return n


def test_three_threads_give_single_thread_results(tokenizer):
    m = make_tiny("llama", tokenizer)
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before = m.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    n_hooks = _hooks(m)

    def run(job: tuple[str, int]):
        kind, seed = job
        if kind == "circuit":
            c = find_circuit(m, _pairs(seed), method="eap", n=12, curve=False, progress=False)
            return torch.cat([c.scores[c.graph.valid], torch.tensor([c.faithfulness])])
        if kind == "ships":
            return ships(m, QUERIES[seed % 2 :], heads=[(0, 0), (1, 2), (2, 3)]).per_prompt
        return attribute(m, QUERIES[seed % 2 :], ablation="ua").per_prompt

    jobs = [(k, s) for s in (0, 1, 2) for k in ("circuit", "ships", "attribute")]
    alone = [run(j) for j in jobs]
    names: set[str] = set()

    def tagged(job):
        names.add(threading.current_thread().name)
        return run(job)

    with ThreadPoolExecutor(3) as ex:
        together = list(ex.map(tagged, jobs))
    assert len(names) == 3
    for job, a, b in zip(jobs, alone, together, strict=True):
        assert torch.allclose(a, b, atol=1e-6, equal_nan=True), (job, float((a - b).nan_to_num().abs().max()))
    assert _hooks(m) == n_hooks
    with torch.no_grad():
        after = m.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    assert torch.equal(before, after)
