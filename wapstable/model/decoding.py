"""Greedy and beam-search decoding for WAP.

Neither function changes the model's mode: call `model.eval()` first (BatchNorm running stats, no dropout), and
restore train mode after if needed. Both run under torch.no_grad themselves.
Results are token indices without the end token `<eol>` = 0. Attention maps, when asked for, are (T_i, h, w) per
sample on the batch's feature grid (crop with feat_mask), one map per returned token.
"""

import torch
from torch import Tensor


@torch.no_grad()
def greedy_decode(
    model,
    images: Tensor,
    image_mask: Tensor,
    max_len: int,
    return_attention: bool = False,
    scores_out: list | None = None,
    length_power: float = 1.0,
) -> list[list[int]] | tuple[list[list[int]], list[Tensor]]:
    """The most likely token at each step, until `<eol>` or `max_len` tokens. `scores_out`, when given, receives each
    image's log-prob / length ** `length_power` (the length counting the `<eol>` where there is one), as
    beam_search scores."""
    B = images.size(0)
    state = model.init_state(*model.encode(images, image_mask))
    prev = torch.full((B,), model.start_index, dtype=torch.long, device=images.device)
    done = torch.zeros(B, dtype=torch.bool, device=images.device)
    tokens = torch.zeros(B, 0, dtype=torch.long, device=images.device)  # (B, t)
    att = state.coverage.new_zeros(B, 0, *state.coverage.shape[1:])  # (B, t, h, w)
    total = torch.zeros(B, device=images.device)
    length = torch.zeros(B, device=images.device)
    for _ in range(max_len):
        log_probs, state, alpha = model.step(state, prev)
        best, prev = log_probs.max(-1)  # (B,)
        total += best.float().masked_fill(done, 0.0)
        length += (~done).float()
        tokens = torch.cat([tokens, prev[:, None]], 1)
        if return_attention:
            att = torch.cat([att, alpha.unsqueeze(1).to(att.dtype)], 1)
        done |= prev == 0
        if done.all():
            break
    seqs = [seq[: seq.index(0)] if 0 in seq else seq for seq in tokens.tolist()]
    if scores_out is not None:
        scores_out.extend((total / length.clamp_min(1) ** length_power).tolist())
    return (seqs, [att[i, : len(seq)] for i, seq in enumerate(seqs)]) if return_attention else seqs


@torch.no_grad()
def beam_search(
    model,
    images: Tensor,
    image_mask: Tensor,
    beam_size: int,
    max_len: int,
    return_attention: bool = False,
    scores_out: list | None = None,
    length_power: float = 1.0,
) -> list[list[int]] | tuple[list[list[int]], list[Tensor]]:
    """WAP's beam search, batched: the K beams of image b are rows b*K .. b*K + K-1 of one decoder batch.

    As in WAP's gen_sample, a hypothesis that emits `<eol>` leaves the beam, which then keeps K - (finished) live
    hypotheses; an image is done when K have finished, or at `max_len`, where its live hypotheses compete too.
    The final pick maximises log-prob / length ** `length_power` (decode.length_power; 1 as WAP, 0 the plain
    log-prob, which favours shorter readings), the length counting the `<eol>` where there is one; `scores_out`,
    when given, receives that figure of each image's pick.
    """
    B, K = images.size(0), beam_size
    device = images.device
    state = model.init_state(*model.encode(images, image_mask))
    state = model.select_state(state, torch.arange(B, device=device).repeat_interleave(K))  # (B*K, ...)
    rows = torch.arange(B, device=device)[:, None]  # (B, 1)
    rank = torch.arange(K, device=device)[None]  # (1, K)
    # Only beam 0 is live at first: K identical copies would otherwise fill the beam with one hypothesis.
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0
    n_live = torch.full((B,), K, device=device)
    hist = torch.zeros(B, K, 0, dtype=torch.long, device=device)  # (B, K, t) tokens so far
    hw = state.coverage.shape[1:]
    att = state.coverage.new_zeros(B, K, 0, *hw) if return_attention else None  # (B, K, t, h, w)
    prev = torch.full((B * K,), model.start_index, dtype=torch.long, device=device)
    finished: list[list[tuple[float, list[int], Tensor | None]]] = [[] for _ in range(B)]
    for _ in range(max_len):
        log_probs, state, alpha = model.step(state, prev)  # (B*K, V), ..., (B*K, h, w)
        V = log_probs.size(-1)
        cand = (scores.unsqueeze(-1) + log_probs.view(B, K, V)).view(B, K * V)  # -inf below dead beams
        top, idx = cand.topk(K, dim=1)  # (B, K), best first
        beam, tok = idx // V, idx % V
        # Of the K best, only the first n_live count: WAP draws K - (finished) candidates per step.
        counts = (rank < n_live[:, None]) & (top > float("-inf"))
        ended, live = counts & (tok == 0), counts & (tok != 0)
        hist = torch.cat([hist[rows, beam], tok.unsqueeze(-1)], -1)
        if att is not None:
            parent = alpha.view(B, K, *hw)[rows, beam]  # (B, K, h, w) the map that chose tok
            att = torch.cat([att[rows, beam], parent.unsqueeze(2).to(att.dtype)], 2)
        for b, r in ended.nonzero().tolist():
            finished[b].append(
                (
                    top[b, r].item() / hist.size(2) ** length_power,
                    hist[b, r, :-1].tolist(),
                    _at(att, b, r, -1),
                )
            )
        n_live = n_live - ended.sum(1)
        scores = top.masked_fill(~live, float("-inf"))
        if not live.any():
            break
        # Rows only move between the beams of one image, so the per-image memory needs no copy.
        state = model.select_state(state, (rows * K + beam).view(-1), memory=False)
        prev = tok.view(-1)
    seqs, maps = [], []
    for b in range(B):
        hyps = finished[b]
        # Still live after max_len steps: they compete too, normalised by their own length (no <eol>).
        for r in (scores[b] > float("-inf")).nonzero().flatten().tolist():
            hyps.append(
                (
                    scores[b, r].item() / max(hist.size(2), 1) ** length_power,
                    hist[b, r].tolist(),
                    _at(att, b, r, None),
                )
            )
        if not hyps:  # every score NaN (a model gone non-finite): an empty hypothesis, not a crash
            hyps.append((float("-inf"), [], _at(att, b, 0, 0)))
        score, seq, a = max(hyps, key=lambda h: h[0])
        if scores_out is not None:
            scores_out.append(score)
        seqs.append(seq)
        maps.append(a)
    return (seqs, maps) if return_attention else seqs


def _at(att: Tensor | None, b: int, r: int, end: int | None) -> Tensor | None:
    return None if att is None else att[b, r, :end]
