"""`patch` progress counts work, not rows (issue 40, item 6): a row patched at layer 0 and an
early position recomputes every layer and most columns, one at the last layer and position almost
nothing, so equal steps per row made the ETA swing from minutes to an hour and back."""

from __future__ import annotations

import pytest

import heads.scorers.patching.activation as act
from heads.engine.options import SweepOptions
from heads.scorers.patching import encode_pairs
from heads.scorers.patching.activation import patch
from tests.support.patching import PAIRS


@pytest.mark.parametrize("kind", ["head_out_by_pos", "head_out"])
def test_progress_follows_the_work_each_forward_does(tiny_llama, monkeypatch, kind):
    L = tiny_llama.n_layers
    work = [0]  # token-layers computed, measured at the forwards themselves
    per_chunk: list[int] = []

    def counted(fn, start_of):
        def wrapper(model, ids, *a, **k):
            work[0] += ids.shape[0] * ids.shape[1] * (L - start_of(k))
            return fn(model, ids, *a, **k)

        return wrapper

    def chunk(*a, **k):
        before = work[0]
        out = run_chunk(*a, **k)
        per_chunk.append(work[0] - before)
        return out

    run_chunk = act._run_chunk
    monkeypatch.setattr(act, "run_rows", counted(act.run_rows, lambda k: k["start"]))
    monkeypatch.setattr(act, "_one_column_output", counted(act._one_column_output, lambda k: L - 1))
    monkeypatch.setattr(act, "_run_chunk", chunk)
    seen: list[tuple[int, int]] = []
    opts = SweepOptions(max_rows=3, progress=lambda d, t: seen.append((d, t)))
    patch(tiny_llama, encode_pairs(tiny_llama, PAIRS), kind, options=opts)
    assert len(seen) == len(per_chunk) > 3
    done, total = [d for d, _ in seen], seen[-1][1]
    assert done == sorted(done) and done[-1] == total and {t for _, t in seen} == {total}
    # each step's share of the progress is its share of the computed work (within 2x: the
    # one-column path of head_out_by_pos saves a little); counted in rows, steps differ by ~L x T
    steps = [b - a for a, b in zip([0, *done], done, strict=False)]
    for dp, dw in zip(steps, per_chunk, strict=True):
        assert 0.5 <= (dp / total) / (dw / sum(per_chunk)) <= 2.0, (steps, per_chunk)


def test_path_patching_progress_follows_the_work(tiny_llama, monkeypatch):
    """The same for path patching to the logits: a sender in layer 0 runs every layer above it."""
    import heads.scorers.patching.path as path

    L = tiny_llama.n_layers
    work = [0]
    per_chunk: list[int] = []
    rows, run_chunk = path.run_rows, path._run_chunk

    def counted(model, ids, *a, **k):
        work[0] += ids.shape[0] * ids.shape[1] * (L - k["start"])
        return rows(model, ids, *a, **k)

    def chunk(*a, **k):
        before = work[0]
        out = run_chunk(*a, **k)
        per_chunk.append(work[0] - before)
        return out

    monkeypatch.setattr(path, "run_rows", counted)
    monkeypatch.setattr(path, "_run_chunk", chunk)
    seen: list[tuple[int, int]] = []
    opts = SweepOptions(max_rows=3, progress=lambda d, t: seen.append((d, t)))
    path.path_patch(tiny_llama, encode_pairs(tiny_llama, PAIRS), options=opts)
    assert len(seen) == len(per_chunk) > 2 and len(set(per_chunk)) > 1
    done, total = [d for d, _ in seen], seen[-1][1]
    assert done == sorted(done) and done[-1] == total
    # to the logits every forward recomputes one column from the sender's layer up: exactly its work
    steps = [b - a for a, b in zip([0, *done], done, strict=False)]
    assert steps == per_chunk and total == sum(per_chunk)
