"""`RoleScores`' dict-style reads warn one release (`DeprecationWarning` naming the new spelling,
pointing at the caller's line) and the new spellings (`head_scores`, `roles`, `as_dict`) do not;
the product's own callers (`head_atlas`, pickling, `save` / `load`) never trigger the warning."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from heads.results.roles import RoleScores
from heads.results.scores import HeadScores


def _roles() -> RoleScores:
    g = torch.Generator().manual_seed(0)
    return RoleScores(
        {
            name: HeadScores(torch.rand(3, 4, generator=g), name, model="tiny", n_kv_heads=2)
            for name in ("induction", "previous_token")
        }
    )


DICT_READS = [
    ("[name]", lambda r: r["induction"], "head_scores('induction')"),
    (".get", lambda r: r.get("induction"), "head_scores('induction')"),
    ("iteration", lambda r: list(r), "scores.roles"),
    ("in", lambda r: "induction" in r, "in scores.roles"),
    (".keys", lambda r: r.keys(), "scores.roles"),
    (".values", lambda r: r.values(), "scores.head_scores(name)"),
    (".items", lambda r: r.items(), "scores.as_dict().items()"),
    ("dict()", lambda r: dict(r), "scores.roles"),
    ("**", lambda r: {**r}, "scores.roles"),
]


@pytest.mark.parametrize("what,read,new", DICT_READS, ids=[d[0] for d in DICT_READS])
def test_each_dict_style_read_warns_naming_the_new_spelling(what, read, new):
    roles = _roles()
    with pytest.warns(DeprecationWarning, match="dict-style access") as got:
        value = read(roles)
    assert any(new in str(w.message) for w in got), [str(w.message) for w in got]
    assert all(w.filename == __file__ for w in got)  # stacklevel: the caller's line, not ours
    # the old reads still give what they gave
    want = {"[name]": roles.head_scores("induction"), ".get": roles.head_scores("induction"), "in": True}
    if what in want:
        assert value is want[what] or value == want[what]
    elif what in ("iteration", ".keys"):
        assert list(value) == ["induction", "previous_token"]
    elif what in ("dict()", "**", ".items"):
        assert dict(value) == roles.as_dict()


def test_old_reads_keep_their_dict_behaviour():
    roles = _roles()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(KeyError):
            roles["retrieval"]
        assert roles.get("retrieval", 7) == 7 and "retrieval" not in roles
        assert [s.method for s in roles.values()] == ["induction", "previous_token"]


def test_new_spellings_and_the_product_never_warn(tmp_path):
    roles = _roles()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert roles.roles == ("induction", "previous_token")
        assert roles.head_scores() is roles.head_scores("induction")
        d = roles.as_dict()
        assert type(d) is dict and d["previous_token"] is roles.head_scores("previous_token")
        assert len(roles) == 2 and bool(roles)
        frame = roles.to_frame()
        assert list(frame.columns) == ["layer", "head", "kv_head", "induction", "previous_token"]
        assert "2 roles ['induction', 'previous_token']" in repr(roles)
        back = RoleScores.load(roles.save(tmp_path / "roles.json"))
        torch.testing.assert_close(back.head_scores("previous_token").scores, d["previous_token"].scores)
        for clone in (pickle.loads(pickle.dumps(roles)), copy.deepcopy(roles), copy.copy(roles)):
            assert type(clone) is RoleScores and clone.roles == roles.roles
            torch.testing.assert_close(clone.head_scores().scores, roles.head_scores().scores)


def test_head_atlas_takes_role_scores_without_the_warning(tokenizer):
    from heads.scorers.roles import head_atlas
    from tests.support import make_tiny

    model = make_tiny("llama", tokenizer, attn="eager")
    g = torch.Generator().manual_seed(1)
    roles = RoleScores(
        {
            n: HeadScores(
                torch.rand(model.n_layers, model.n_heads, generator=g), n, n_kv_heads=model.n_kv_heads
            )
            for n in ("induction", "previous_token")
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        atlas = head_atlas(model, detectors=roles, thumbnails=False)
    assert atlas.frame["induction"].tolist() == roles.head_scores("induction").scores.flatten().tolist()


def test_the_checkpoint_tidy_rows_and_the_atlas_scores_take_role_scores_without_the_warning(tokenizer):
    from heads.dynamics.analyses import tidy
    from heads.scorers.roles import head_atlas
    from tests.support import make_tiny

    roles = _roles()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        rows = tidy(roles).scores
    assert {r["metric"] for r in rows} == {"induction", "previous_token"} and len(rows) == 2 * 12
    got = {(r["metric"], r["layer"], r["head"]): r["score"] for r in rows}
    assert got[("previous_token", 2, 3)] == float(roles.head_scores("previous_token").scores[2, 3])
    model = make_tiny("llama", tokenizer, attn="eager")
    g = torch.Generator().manual_seed(2)
    extra = RoleScores(
        {"extra": HeadScores(torch.rand(model.n_layers, model.n_heads, generator=g), "x", n_kv_heads=2)}
    )
    det = {"induction": extra.head_scores("extra")}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        atlas = head_atlas(model, detectors=det, scores=extra, thumbnails=False)
    assert atlas.frame["extra"].tolist() == extra.head_scores().scores.flatten().tolist()
