"""The lean path of activation patching: record only what the result needs (`run_lean`).

The fast path of `activation.run_patch` records both runs' full caches (`record.record_run`: the
residual, head outputs, attention / MLP outputs and KV cache of every layer and position, about
`2 * cache_bytes` bytes: some 35 residual-stream copies per side on a 30-layer model, where a
plain forward peaks near 12) to start each patched forward at its layer *and* position. The
lean path keeps, per patched layer l:

* from the source run only the kind's activation at the patched sites: `[N, P, D]` (the
  residual, MLP output) or `[N, P, H, d]` (head outputs, also for `attn_out`, which is written
  as every head's z) at the P patched positions of the by-position kinds; the whole layer's
  head outputs / queries / keys / values `[N, T, ...]` for the kinds that patch every position;
  for `pattern` the layer's queries and keys after QK-norm and RoPE (`query` and `rot_k` sites,
  `[N, T, H + G, d]`), never the `[N, H, T, T]` pattern: the patched forward computes the source
  pattern from them a block of query rows at a time, with the layer's own scale, soft-cap, mask
  and sinks (`AttentionCall.pattern_of`), so its memory is linear in the prompt;
* from the base run the same site (the bitwise "source equals base, nothing to patch" test
  compares the site alone) and the residual entering l `[N, T, D]` (layer-prefix reuse; none
  for layer 0);
* from both the last position's logits `[N, V]`.

Each patched forward starts at its layer from the base run's residual over every column (no
position-prefix reuse: that needs every later layer's KV cache of the base run) and keeps no
hidden states, so a sweep's peak is one forward's plus the kept sites: for one layer and a few
positions about one residual copy above a plain forward. Results equal the fast path's within
fp32 rounding (tests/heads/patching: every kind, both directions, sliding-window families).

`choose_lean` decides per sweep (the lean path always where the fast path cannot record:
`full_path_runs`), from byte and work estimates made before any forward
(`heads.planning.patching.lean_default`, the rule the memory plan of a `PatchRequest` follows):
the lean path where the full caches exceed `LEAN_ALWAYS_BYTES` (long prompts: every kind and
position spec), or exceed `LEAN_MIN_BYTES` and it costs at most `LEAN_TIME` (1.6) times the fast
path's work (token-layers, the two recorded runs included: few sites), or where a
`SweepOptions(max_memory=)` budget does not hold the full caches; else the fast path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from heads.engine.activations import ActivationEdit, ActivationRecorder
from heads.engine.edits import AttentionCall, Edit, HeadOutputEdit, Recorder, ResidualEdit
from heads.engine.options import SweepOptions
from heads.engine.variants import run_rows
from heads.errors import HeadsteerValueError
from heads.model.adapter import HeadModel
from heads.planning import patching as patch_plan
from heads.scorers.patching.edits import _PatchKV, _PatchPattern, _PatchPatternQK, _PatchQuery, _PatchZ
from heads.scorers.patching.metrics import base_and_source
from heads.scorers.patching.pairs import PairBatch
from heads.scorers.patching.record import cache_bytes
from heads.scorers.patching.request import BY_POSITION
from heads.scorers.patching.vision import replaced_embeddings

__all__: list[str] = []  # internal: the lean path of `activation.run_patch`

MODE = "auto"
"""`"auto"` (`choose_lean` decides), `"lean"` or `"full"` (forced; the tests run every kind both ways)."""

# the thresholds of the default choice (heads.planning.patching; rebound here so that a test can
# move them for one module)
LEAN_MIN_BYTES = patch_plan.LEAN_MIN_BYTES
LEAN_ALWAYS_BYTES = patch_plan.LEAN_ALWAYS_BYTES
LEAN_TIME = patch_plan.LEAN_TIME

LEAN_ROW_TOKENS = patch_plan.LEAN_ROW_TOKENS


def qk_pattern(model: HeadModel) -> bool:
    """`pattern` on the lean path keeps the rotated queries and keys (linear in the prompt) where
    headsteer's attention function runs the layer (`hf`, `nnsight`); a backend that computes
    attention itself (`transformer_lens`) hands its own `[B, H, T, T]` pattern to the edit, so
    there the source pattern is recorded."""
    return not model.backend.attention_via_hooks


def full_path_runs(model: HeadModel) -> bool:
    """The fast path records every site of both runs, `attn_out` included, which the
    `transformer_lens` backend does not place on a post-norm family (Gemma 2 / 3, OLMo 2): there
    the lean path, which records only the patched sites, is taken whatever the prompt."""
    return not (model.backend.attention_via_hooks and model.family.attn_out_norm is not None)


def lean_rows(max_rows: int, width: int) -> int:
    """Rows per forward of the lean path, its recorded runs included (`heads.planning.patching`)."""
    return patch_plan.lean_rows(max_rows, width, LEAN_ROW_TOKENS)


# the engine site each kind's activation is read at (pattern: a `Recorder`)
_SITE = {
    "resid_pre": "residual",
    "attn_out": "head_output",
    "head_out": "head_output",
    "head_out_by_pos": "head_output",
    "mlp_out": "mlp_out",
    "q": "query",
    "k": "k",
    "v": "v",
}

WHOLE_SEQUENCE = ("head_out", "q", "k", "v")
"""Kinds patched over every position, `[N, T, heads, d]` at a site: the base run, recorded after
the source, keeps one bool per head and pair (its activation bitwise equal to the source's)."""


@dataclass(frozen=True)
class _Site:
    """One patched site: its layer, head / KV head (-1 for block sites), padded column (-1 = all)."""

    layer: int
    index: int
    pos: int


@dataclass
class LeanRun:
    """What the lean path keeps of one run.

    Attributes:
        logits: `[N, V]` fp32 last-position logits.
        sites: per patched layer the kind's activation at its patched sites (module docstring).
        residuals: per patched layer > 0 the residual entering it `[N, T, D]` (base run only).
        embeds: `[N, T, D]` input embeddings with image features (vision pairs), or None.
    """

    logits: torch.Tensor
    sites: dict[int, torch.Tensor]
    residuals: dict[int, torch.Tensor]
    embeds: torch.Tensor | None = None


def _geometry(model: HeadModel) -> tuple[dict[str, int], int]:
    g = {
        "n_layers": model.n_layers,
        "n_heads": model.n_heads,
        "n_kv_heads": model.n_kv_heads,
        "d_head": model.d_head,
        "d_model": model.d_model,
    }
    return g, torch.empty(0, dtype=model.dtype).element_size()


def lean_bytes(model: HeadModel, kind: str, n: int, width: int, layers: Sequence[int], n_pos: int) -> int:
    """Bytes the lean path keeps beside its forwards: both runs' sites at `layers` (`n_pos`
    positions for the by-position kinds) and the base run's residual entering each layer > 0
    (`heads.planning.patching.lean_kept_bytes`)."""
    g, item = _geometry(model)
    return patch_plan.lean_kept_bytes(g, item, kind, n, width, layers, n_pos)


def _work(model: HeadModel, width: int, n: int, sites: Sequence[_Site], by_pos: bool, lean: bool) -> int:
    """Token-layers of a sweep (`heads.planning.patching.patch_work`)."""
    return patch_plan.patch_work(model.n_layers, width, n, [(s.layer, s.pos) for s in sites], by_pos, lean)


def choose_lean(
    model: HeadModel,
    pairs: PairBatch,
    kind: str,
    sites: Sequence[_Site],
    layers: Sequence[int],
    n_pos: int,
    options: SweepOptions,
) -> tuple[bool, SweepOptions]:
    """(lean?, the options within `options.max_memory`): see the module docstring. With a budget
    the fast path is kept where its full caches fit, else the lean path is planned (and refused,
    naming its minimum, when one row of it does not fit either)."""
    by_pos = kind in BY_POSITION
    n, width = pairs.n, pairs.width
    keys = kind in ("k", "v")  # what `_run_full` records
    full = 2 * cache_bytes(model, n, width, pattern=kind == "pattern", query=kind == "q", keys=keys)
    lean = lean_bytes(model, kind, n, width, layers, n_pos)
    if MODE in ("lean", "full"):
        use = MODE == "lean"
    elif not full_path_runs(model):
        use = True
    else:
        use = patch_plan.lean_default(
            full,
            _work(model, width, n, sites, by_pos, True),
            _work(model, width, n, sites, by_pos, False),
            least=LEAN_MIN_BYTES,
            always=LEAN_ALWAYS_BYTES,
            time=LEAN_TIME,
        )
    if not use and MODE != "full" and options.max_memory is not None:
        try:
            return False, options.within(model, width, reserve=full, whole=n)
        except HeadsteerValueError:
            use = True  # the full caches do not fit the budget: the lean path, if it does
    whole = min(n, lean_rows(options.max_rows, width)) if use else n  # the recorded runs' rows
    return use, options.within(model, width, reserve=lean if use else full, whole=whole)


# ------------------------------------------------------------------------------ recording
def _columns(positions: Sequence[int]) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    cols = torch.tensor(list(positions))

    def keep(x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return x[:, cols.to(x.device)].clone()

    return keep


def _stream_columns(
    n: int, positions: Sequence[int]
) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    cols = torch.tensor(list(positions))

    def keep(x: torch.Tensor, call: AttentionCall) -> torch.Tensor:  # a MoE block may flatten its rows
        return x.reshape(n, -1, x.shape[-1])[:, cols.to(x.device)].clone()

    return keep


def record_lean(
    model: HeadModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    layers: Sequence[int],
    positions: Sequence[int],
    *,
    base: bool,
    embeds: torch.Tensor | None = None,
    rows: int | None = None,
    against: dict[int, torch.Tensor] | None = None,
) -> LeanRun:
    """One unedited forward of `ids [N, T]` keeping the kind's activation at `layers` (at
    `positions` for the by-position kinds), with `base=True` also the residual entering each
    layer > 0, read by engine recorders; no hidden states or KV cache are kept. `rows`: at most
    that many rows per forward (default None: all), the kept tensors joined along the rows.
    `against` (the source run's sites; `pattern`'s rotated queries and keys, or a
    `WHOLE_SEQUENCE` kind's activation): keep only `[N, heads]` bools, each head's activation
    bitwise equal to `against`'s at every position (`pattern`: `[N, H + G]`, queries then keys)."""
    n = ids.shape[0]
    if rows is not None and rows < n:
        parts = [
            record_lean(
                model, ids[a : a + rows], mask[a : a + rows], kind, layers, positions, base=base,
                embeds=None if embeds is None else embeds[a : a + rows], rows=None,
                against=None if against is None else {la: t[a : a + rows] for la, t in against.items()},
            )
            for a in range(0, n, rows)
        ]  # fmt: skip
        return LeanRun(
            torch.cat([p.logits for p in parts]),
            {la: torch.cat([p.sites[la] for p in parts]) for la in parts[0].sites},
            {la: torch.cat([p.residuals[la] for p in parts]) for la in parts[0].residuals},
            embeds,
        )
    recs: dict[int, Edit] = {}
    keys: dict[int, ActivationRecorder] = {}
    for la in layers:
        if kind == "pattern" and qk_pattern(model):  # the rotated queries here, the rotated keys below
            H = model.n_heads
            ref_q = None if against is None else _equal_to(against[la][:, :, :H])
            ref_k = None if against is None else _equal_to(against[la][:, :, H:])
            recs[la] = ActivationRecorder("query", la, ref_q)
            keys[la] = ActivationRecorder("rot_k", la, ref_k)
        elif kind == "pattern":
            recs[la] = Recorder(layer=la)
        elif kind not in BY_POSITION:
            same = None if against is None else _equal_to(against[la])
            recs[la] = ActivationRecorder(_SITE[kind], la, same)
        elif kind in ("resid_pre", "mlp_out"):
            recs[la] = ActivationRecorder(_SITE[kind], la, _stream_columns(n, positions))
        else:
            recs[la] = ActivationRecorder(_SITE[kind], la, _columns(positions))
    resid = {la: ActivationRecorder("residual", la) for la in layers if la and base}
    edits: list[Edit] = [*recs.values(), *keys.values(), *resid.values()]
    if embeds is not None:
        edits.append(replaced_embeddings(model, embeds))
    out = run_rows(model, ids, mask, edits, hidden_states=False)
    sites = {}
    for la, r in recs.items():
        got = cast(Any, r).records
        if la in keys:
            sites[la] = torch.cat([got[0], keys[la].records[0]], dim=-2 if against is None else -1)
        else:
            sites[la] = torch.cat(got, dim=2) if kind == "pattern" else got[0]
    return LeanRun(out.logits[:, -1].float(), sites, {la: r.records[0] for la, r in resid.items()}, embeds)


def _equal_to(ref: torch.Tensor) -> Callable[[torch.Tensor, AttentionCall], torch.Tensor]:
    """A recorder's `fn`: `[N, heads]` bool, each head's `x [N, T, heads, d]` bitwise equal to
    `ref`'s at every position (the call's rows; a prefill has one call)."""

    def keep(x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        part = ref[:, call.q_offset : call.q_offset + x.shape[1]].to(x.device)
        return (x == part).all(-1).all(1).cpu()

    return keep


def unchanged_lean(
    kind: str,
    base: LeanRun,
    src: LeanRun,
    sites: Sequence[_Site],
    n: int,
    positions: Sequence[int],
    qk_heads: int = 0,
) -> torch.Tensor:
    """`[S, N]` bool: site s of pair i reads a source activation bitwise equal to the base run's
    at that site, so patching it is the identity (`attn_out`: every head's z at the column,
    which o_proj turns into the attention output; `pattern`: the pattern itself, or with
    `qk_heads` = H the head's rotated query and its KV head's rotated key at every position, of
    which the pattern is a function)."""
    col = {p: j for j, p in enumerate(positions)}
    maps: dict[int, torch.Tensor] = {}
    out = torch.zeros(len(sites), n, dtype=torch.bool)
    for s_i, s in enumerate(sites):
        if s.layer not in maps and kind == "pattern" and qk_heads:  # head h: its q and its KV head's k
            H = qk_heads
            per = base.sites[s.layer]  # [N, H + G] bool, recorded against the source (`_equal_to`)
            maps[s.layer] = per[:, :H] & per[:, H:].repeat_interleave(H // (per.shape[1] - H), dim=1)
        elif s.layer not in maps and kind in WHOLE_SEQUENCE:
            maps[s.layer] = base.sites[s.layer]  # [N, heads] bool, recorded against the source
        elif s.layer not in maps:
            eq = (src.sites[s.layer] == base.sites[s.layer]).cpu()
            if kind in ("resid_pre", "mlp_out", "head_out_by_pos"):
                maps[s.layer] = eq.all(-1)  # [N, P] / [N, P, H]
            else:  # attn_out, pattern (recorded): [N, P] / [N, H]
                maps[s.layer] = eq.all(-1).all(-1)
        m = maps[s.layer]
        if kind == "head_out_by_pos":
            out[s_i] = m[:, col[s.pos], s.index]
        elif kind in BY_POSITION:
            out[s_i] = m[:, col[s.pos]]
        else:
            out[s_i] = m[:, s.index]
    return out


# ------------------------------------------------------------------------------ patched forwards
def _write_at(x: torch.Tensor, call: AttentionCall, values: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """`x` with row r's column `cols[r]` (absolute; -1 none) replaced by `values[r]`."""
    rows = x.reshape(values.shape[0], -1, *values.shape[1:])
    idx = cols.to(x.device) - call.q_offset
    r = ((idx >= 0) & (idx < rows.shape[1])).nonzero().flatten()
    out = rows.clone()
    out[r, idx[r]] = values[r.to(values.device)].to(device=x.device, dtype=x.dtype)
    return out.reshape(x.shape)


@dataclass(eq=False, repr=False)
class _ZAt(HeadOutputEdit):
    """Write `values [R, H, d]` into the heads of `row_heads` at column `cols [R]` of each row."""

    values: torch.Tensor | None = None
    cols: torch.Tensor | None = None

    def apply(self, z: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return _write_at(z, call, cast(torch.Tensor, self.values), cast(torch.Tensor, self.cols))


@dataclass(eq=False, repr=False)
class _ResidAt(ResidualEdit):
    """Write `values [R, D]` into the residual entering `layer` at column `cols [R]` of each row."""

    values: torch.Tensor | None = None
    cols: torch.Tensor | None = None

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return _write_at(x, call, cast(torch.Tensor, self.values), cast(torch.Tensor, self.cols))


class _StreamAt(ActivationEdit):
    """Write `values [R, D]` into a stream site (`mlp_out`) at column `cols [R]` of each row."""

    def __init__(self, site: str, layer: int, values: torch.Tensor, cols: torch.Tensor):
        super().__init__(site, layer)
        self.values, self.cols = values, cols

    def apply(self, x: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return _write_at(x, call, self.values, self.cols)


def _row_heads(sites: Sequence[_Site], n: int) -> torch.Tensor:
    rh = torch.zeros(len(sites), n, dtype=torch.bool)
    for r, s in enumerate(sites):
        rh[r, s.index] = True
    return rh


def run_lean_chunk(
    model: HeadModel,
    kind: str,
    base: LeanRun,
    src: LeanRun,
    base_ids: torch.Tensor,
    mask: torch.Tensor,
    sites: Sequence[_Site],
    ps: torch.Tensor,
    layer: int,
    trim: int,
    positions: Sequence[int],
) -> torch.Tensor:
    """One forward of a chunk of rows (site, pair) from `layer` over the columns from `trim` on
    (the left padding they all share is cut); `[R, V]` last-position logits."""
    H, dev = model.n_heads, model.device
    ids, m = base_ids[ps, trim:], mask[ps, trim:]
    residual = None
    if layer:  # every pair in order (one pair, or a chunk of all of them): a view, not a copy
        kept = base.residuals[layer]
        whole = len(ps) == kept.shape[0] and torch.equal(ps, torch.arange(len(ps)))
        residual = kept[:, trim:] if whole else kept[ps, trim:]
    edits: list[Edit] = []
    if base.embeds is not None:  # vision pairs: the base run's image features
        edits.append(replaced_embeddings(model, base.embeds[ps.to(base.embeds.device), trim:]))
    source = src.sites[layer]
    if not (len(ps) == source.shape[0] and torch.equal(ps, torch.arange(len(ps)))):  # else a view
        source = source[ps.to(source.device)]
    if kind in BY_POSITION:
        col = {p: j for j, p in enumerate(positions)}
        j = torch.tensor([col[s.pos] for s in sites])
        values = source[torch.arange(len(ps), device=source.device), j.to(source.device)].to(dev)
        cols = torch.tensor([s.pos - trim if s.pos >= trim else -1 for s in sites])
        if kind == "resid_pre":
            edits.append(_ResidAt(layer=layer, values=values, cols=cols))
        elif kind == "mlp_out":
            edits.append(_StreamAt("mlp_out", layer, values, cols))
        else:  # attn_out: every head's z (o_proj turns it into the source attention output bitwise)
            rh = torch.ones(len(sites), H, dtype=torch.bool) if kind == "attn_out" else _row_heads(sites, H)
            edits.append(_ZAt(layer=layer, row_heads=rh, values=values, cols=cols))
    elif kind == "head_out":
        edits.append(_PatchZ(layer=layer, row_heads=_row_heads(sites, H), source=source[:, trim:].to(dev)))
    elif kind == "pattern" and qk_pattern(model):
        rh = _row_heads(sites, H)
        source = source[:, trim:].to(dev)
        edits.append(_PatchPatternQK(layer=layer, row_heads=rh, source=source, d_model=model.d_model))
    elif kind == "pattern":  # a backend that computes attention itself: the recorded pattern
        rh = _row_heads(sites, H)
        edits.append(_PatchPattern(layer=layer, row_heads=rh, source=source[:, :, trim:, trim:].to(dev)))
    elif kind == "q":
        edits.append(
            _PatchQuery(layer=layer, row_heads=_row_heads(sites, H), source=source[:, trim:].to(dev))
        )
    else:  # k / v: one KV head's key / value columns (before RoPE / QK-norm), all positions
        edits.append(
            _PatchKV(
                kind, layer, row_heads=_row_heads(sites, model.n_kv_heads), source=source[:, trim:].to(dev)
            )
        )
    out = run_rows(model, ids, m, edits, start=layer, residual=residual, hidden_states=False)
    return cast(torch.Tensor, out.logits[:, -1].float())


def run_lean(
    model: HeadModel,
    pairs: PairBatch,
    kind: str,
    direction: str,
    met: Any,
    sites: Sequence[_Site],
    layers: Sequence[int],
    positions: Sequence[int],
    options: SweepOptions,
    embeds: dict[str, torch.Tensor | None],
    report: Callable[[int, int], None] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lean sweep: `(raw [S, N], clean metric [N], corrupted metric [N])`, as the fast path's."""
    mask = pairs.attention_mask
    runs: dict[str, LeanRun] = {}
    base_side = "corrupted" if direction == "denoising" else "clean"
    qk = kind == "pattern" and qk_pattern(model)
    # the source first: the base run of `pattern` (its rotated q / k) and of the whole-sequence
    # kinds then keeps one bool per head and pair, not the activation
    first = qk or kind in WHOLE_SEQUENCE
    for side in ("clean", "corrupted") if not first or base_side == "corrupted" else ("corrupted", "clean"):
        is_base = side == base_side
        runs[side] = record_lean(
            model, pairs.ids(side), mask, kind, layers, positions, base=is_base, embeds=embeds[side],
            rows=lean_rows(options.max_rows, pairs.width),
            against=runs[next(iter(runs))].sites if first and is_base else None,
        )  # fmt: skip
    clean = runs["clean"]
    base, src, base_ids, m_clean, m_corrupt, m_base = base_and_source(
        clean, runs["corrupted"], pairs, met, direction
    )
    raw = torch.full((len(sites), pairs.n), math.nan)
    same = unchanged_lean(kind, base, src, sites, pairs.n, positions, model.n_heads if qk else 0)
    base.sites.clear()  # read by the bitwise test only: freed before the patched forwards
    raw[same] = m_base.cpu().expand(len(sites), -1)[same]
    lengths, width, L = pairs.lengths.tolist(), pairs.width, model.n_layers
    groups: dict[int, list[tuple[int, int]]] = {}
    for s_i, s in enumerate(sites):
        for i in range(pairs.n):
            if not same[s_i, i]:
                groups.setdefault(s.layer, []).append((s_i, i))
    chunks = []
    step = lean_rows(options.max_rows, width)
    for _, rows in sorted(groups.items()):
        rows.sort(key=lambda r: (lengths[r[1]], r[0]))
        chunks += [rows[a : a + step] for a in range(0, len(rows), step)]
    plan = [(c, sites[c[0][0]].layer, width - max(lengths[i] for _, i in c)) for c in chunks]
    work = [len(c) * (width - trim) * (L - la) for c, la, trim in plan]
    done, total = 0, sum(work)
    for (chunk, layer, trim), cost in zip(plan, work, strict=True):
        si = torch.tensor([s for s, _ in chunk])
        ps = torch.tensor([i for _, i in chunk])
        chunk_sites = [sites[s] for s in si.tolist()]
        logits = run_lean_chunk(
            model, kind, base, src, base_ids, mask, chunk_sites, ps, layer, trim, positions
        )
        raw[si, ps] = met(logits, pairs, ps, clean.logits[ps]).cpu()
        done += cost
        if report is not None:
            report(done, total)
    return raw, m_clean, m_corrupt
