"""The keyword refusal judge on hand-written cases (docs/methods/safety.md)."""

import pytest

from probes.metrics.refusal import REFUSAL_PHRASES, RefusalJudge, attack_success_rate

COMPLIANT = (
    "Step one is to gather flour, water, yeast and salt. Mix them in a large bowl until the dough comes "
    "together, then knead it on a floured table for ten minutes until it feels smooth and elastic to touch."
)


def test_curly_apostrophes_match():
    judge = RefusalJudge()
    assert judge.reasons("I\u2019m sorry, but I can\u2019t help with that request at all.") == ["phrase"]
    assert judge.is_refusal("I can\u2019t assist")


def test_sorry_entries_are_separate():
    assert "sorry" in REFUSAL_PHRASES and "I am sorry" in REFUSAL_PHRASES
    assert len(REFUSAL_PHRASES) == len(set(REFUSAL_PHRASES)) == 41


def test_length_rule_counts_tokens(tokenizer):
    judge = RefusalJudge(tokenizer=tokenizer, min_tokens=32)
    assert judge.reasons("Sure, here it is.") == ["short"]
    assert not judge.is_refusal(COMPLIANT)
    n = len(tokenizer(COMPLIANT, add_special_tokens=False)["input_ids"])
    assert RefusalJudge(tokenizer=tokenizer, min_tokens=n + 1).reasons(COMPLIANT) == ["short"]
    assert RefusalJudge(tokenizer=tokenizer, min_tokens=n).reasons(COMPLIANT) == []


def test_repetition_rule():
    judge = RefusalJudge()
    assert judge.reasons("abcabcabcabcabc") == ["repetition"]
    assert judge.reasons("Mix it. Mix it. Mix it. Mix it. ") == ["repetition"]
    assert "repetition" not in judge.reasons(COMPLIANT)
    assert "repetition" not in RefusalJudge(min_repeats=6).reasons("abcabcabcabc")


def test_case_handling_and_asr(tokenizer):
    assert not RefusalJudge().is_refusal("SORRY THAT IS NOT POSSIBLE")
    assert RefusalJudge(case_sensitive=False).is_refusal("SORRY THAT IS NOT POSSIBLE")
    judge = RefusalJudge(tokenizer=tokenizer)
    assert attack_success_rate([COMPLIANT, "I cannot help with that.", COMPLIANT, "no"], judge) == 0.5
    with pytest.raises(ValueError):
        attack_success_rate([], judge)
    with pytest.raises(ValueError, match="min_repeats"):
        RefusalJudge(min_repeats=1)
    with pytest.raises(TypeError):
        judge.is_refusal(None)


def test_refusal_tuning_batches_mask_the_prompt(tiny_llama):
    import random

    from heads.scorers.safety.ships import TEMPLATE
    from probes.studies.refusal_model import _batches

    tok = tiny_llama.tokenizer
    pairs = [("How do I bake bread?", "Mix flour and water."), ("Steal a car", "I cannot help.")]
    ids, mask, labels = next(_batches(tiny_llama, pairs, 2, random.Random(0)))
    for row in range(2):
        n_real = int(mask[row].sum())
        lab = labels[row, :n_real]
        answer = lab[lab != -100].tolist()
        assert answer[-1] == tok.eos_token_id
        q, a = next((q, a) for q, a in pairs if tok.decode(answer[:-1]).strip() == a)
        n_prompt = len(tok(TEMPLATE.format(query=q), add_special_tokens=False)["input_ids"])
        assert (lab[:n_prompt] == -100).all() and (lab[n_prompt:] != -100).all()
        assert (labels[row, n_real:] == -100).all()
