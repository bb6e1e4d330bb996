"""The pattern detectors' per-block reduction (`heads.scorers.roles.detectors.pattern_scores`).

The engine hands a read-only layer's pattern over in query blocks `p` `[B, H, q, K]` (rows
`a..a+q-1`); `block_sums` reduces one block to per-(batch row, head) sums, the numerator and the
denominator of each detector's score (the formulas are in `detectors`' module docstring). Every
detector is read from the same block in one pass over it:

* the denominators (the pattern mass on the counted keys) and the duplicate-token and induction
  numerators are one batched matrix product of the block with the stacked `[q, K, m]` 0/1 key
  masks (m <= 3), reading the block once instead of once per detector;
* previous-token and self look at one key per row (`j = i - 1`, `j = i`): a gather of `q` entries
  per head, not a product with a `[q, K]` mask;
* entropy is `torch.special.entr` (`-p log p`, 0 at p = 0) summed over the keys.

The masks are built per block from the token ids, over real tokens only, so no `[B, T, T]` mask and
no `[B, H, T, T]` pattern is ever kept.
"""

from __future__ import annotations

import torch

__all__ = ["block_sums"]


def _one_key(
    p: torch.Tensor, kp: torch.Tensor, rq: torch.Tensor, rows: torch.Tensor, shift: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row i's pattern entry at key `i - shift` where that key is counted (`kp` `[B, q, K']`
    0/1, and the row real, `rq`), else 0: `[B, H, q]`, and whether it is counted `[B, q]`."""
    b, h, q, k = p.shape
    col = rows - shift  # [q]
    ok = (col >= 0) & (col < min(k, kp.shape[-1]))
    idx = col.clamp(0, max(0, min(k, kp.shape[-1]) - 1))
    hit = (kp.gather(-1, idx.expand(b, q)[..., None])[..., 0] > 0) & ok & rq  # [B, q]
    val = p.gather(-1, idx.view(1, 1, q, 1).expand(b, h, q, 1))[..., 0]  # [B, H, q]
    return torch.where(hit[:, None], val, 0.0), hit


def block_sums(
    probs: torch.Tensor,
    a: int,
    ids: torch.Tensor,
    real: torch.Tensor,
    first: torch.Tensor,
    names: tuple[str, ...],
    rows: str,
    exclude_bos: bool,
    exclude_current_token: bool,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{detector: (numerator, denominator)}`, each `[B, H]` fp32, of query rows `a..a+q-1`.

    Args:
        probs: the block's pattern `[B, H, q, K]` (fp32; masked keys 0), rows at absolute
            positions `a..a+q-1`, keys `0..K-1`.
        ids: `[B, T]` token ids; real: `[B, T]` bool (padding False); first: `[B]` the first real
            position (left padding). On the pattern's device.
        names: detectors of `PATTERN_DETECTORS`; rows: `"target"` or `"all"`; the two flags as in
            `pattern_scores`.

    Returns:
        for a pattern detector the sum over counted rows of the mass on the detection mask and
        of the mass on the counted keys; for `"entropy"` the sum of normalised row entropies and
        the number of rows with >= 2 visible keys (broadcast to `[B, H]`).
    """
    p = probs.float()
    dev, dtype = p.device, p.dtype
    bsz, _, q, k_len = p.shape
    qrows = torch.arange(a, a + q, device=dev)
    rq = real[:, a : a + q]  # [B, q]
    # visible keys of row i: the real keys j <= i (n_vis, from a running count, no [q, K] mask)
    seen = real[:, :k_len].long().cumsum(-1)  # [B, K]
    n_vis = seen[:, qrows.clamp(max=k_len - 1)] * rq  # [B, q]
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    pattern = [n for n in ("previous_token", "duplicate_token", "induction", "self") if n in names]
    if pattern:
        # keys a row can count lie at or before it: the masks and the product stop at column a + q
        kk = min(k_len, a + q)
        kpos = torch.arange(kk, device=dev)
        # counted keys j of row i (the denominator): j <= i (j < i without the current token), key
        # real (and not the first real token with exclude_bos); the row's own realness `rq` is
        # applied to the row sums below
        key = real[:, :kk]
        if exclude_bos:
            key = key & (kpos[None] != first[:, None])
        cond = kpos[None, :] < (qrows[:, None] + (0 if exclude_current_token else 1))  # [q, kk]
        want: list[str] = [n for n in ("duplicate_token", "induction") if n in names]
        masks = torch.empty(bsz, q, 1 + len(want), kk, dtype=dtype, device=dev)  # [B, q, m, kk]
        kp = torch.mul(cond[None], key[:, None].to(dtype), out=masks[:, :, 0])  # [B, q, kk]
        if want:
            same = ids[:, a : a + q, None] == ids[:, None, :kk]  # tok_i == tok_j
        if "duplicate_token" in want:
            dup = torch.mul(same, kp, out=masks[:, :, 1 + want.index("duplicate_token")])
            torch.diagonal(dup, offset=a, dim1=-2, dim2=-1).fill_(0)  # j < i
        if "induction" in want:
            # key j >= 1: tok_{j-1} == tok_i, key j - 1 real, key j counted (so j - 1 < i)
            ind = masks[:, :, 1 + want.index("induction")]
            ind[..., :1] = 0
            if kk > 1:
                prev_real = kp[..., 1:] * real[:, None, : kk - 1].to(dtype)
                torch.mul(same[..., :-1], prev_real, out=ind[..., 1:])
        # [H, kk] x [kk, m] per (batch row, query row): the block read once for every mask
        sums = torch.stack(
            [torch.matmul(p[b, :, :, :kk].transpose(0, 1), masks[b].transpose(-1, -2)) for b in range(bsz)]
        ).permute(0, 2, 1, 3)  # [B, H, q, m]
        row_mass = sums[..., 0]
        all_rows = n_vis > 0  # rows="all": every real row with a visible key
        for n in pattern:
            if n in ("previous_token", "self"):
                num, hit = _one_key(p, kp, rq, qrows, 1 if n == "previous_token" else 0)
            else:
                i = 1 + want.index(n)
                num, hit = sums[..., i], masks[:, :, i].amax(-1).gt(0) & rq
            counted = (hit if rows == "target" else all_rows)[:, None].to(dtype)  # [B, 1, q]
            out[n] = ((num * counted).sum(-1), (row_mass * counted).sum(-1))
    if "entropy" in names:
        ent = torch.special.entr(p).sum(-1)  # [B, H, q]: -sum p log p
        ok = n_vis >= 2
        norm = torch.log(n_vis.clamp(min=2).float())
        out["entropy"] = (
            (ent / norm[:, None] * ok[:, None]).sum(-1),
            ok.sum(-1)[:, None].float().expand_as(ent[..., 0]),
        )
    return out
