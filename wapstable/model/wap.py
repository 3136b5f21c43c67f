"""WAP, Watch, Attend and Parse (Zhang et al. 2017): a conv watcher and a coverage-attention GRU parser.

Padding is invisible to the output: images are padded with 0 (background) and every spatial op sees the padded
region as exact zeros, like a conv's own zero padding. So an image alone and the same image padded inside a batch
give the same logits in eval mode. That takes three things: the mask is multiplied in after every BN + ReLU that
precedes a spatial op (BN's shift would otherwise turn padded zeros into a constant), pools use ceil_mode (an odd
border column then has its own cell, as it does when the image is alone), and average pools divide by the count
of valid pixels.
"""

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from wapstable.errors import UserError
from wapstable.model.attention import CoverageAttention
from wapstable.model.watchers import build_watcher


@dataclass
class DecoderState:
    """What the parser carries from step to step; every field is batch-first so beams can be index_select-ed."""

    h: Tensor  # (B, H) parser state h_{t-1}
    coverage: Tensor  # (B, h, w) sum of the past steps' alphas
    features: Tensor  # (B, L, C) watcher annotations a_i, L = h*w
    proj: Tensor  # (B, L, A) U a_i, computed once per image
    mask: Tensor  # (B, h, w) valid feature positions
    # (B, V, h, w) the symbol map's log-probabilities at each annotation (model.symbol_readout), else None
    symbols: Tensor | None = None


_MEMORY = ("features", "proj", "mask", "symbols")


def select_state(state: DecoderState, index: Tensor, memory: bool = True) -> DecoderState:
    """The state of rows `index` (B',) of `state`.

    memory=False keeps the per-image tensors (features, proj, mask) as they are: valid, and a large saving, when
    `index` only reorders rows that hold the same image, as beam search does between its beams.
    """
    return DecoderState(
        **{
            f.name: getattr(state, f.name)
            if (not memory and f.name in _MEMORY)
            else getattr(state, f.name).index_select(0, index)
            for f in fields(state)
            if getattr(state, f.name) is not None
        }
    )


class Parser(nn.Module):
    """WAP's conditional GRU decoder: GRU(embedding) -> coverage attention -> GRU(context) -> maxout readout."""

    def __init__(self, cfg, feat_dim: int, vocab_size: int):
        super().__init__()
        E, H, A = cfg.embed_dim, cfg.hidden_dim, cfg.attention
        if E % 2:
            raise ValueError(f"model.embed_dim must be even for the maxout readout's unit pairs (got {E})")
        # One extra row: the start token, index vocab_size (WAP fed zeros at t=0; a learned row is no worse).
        self.embed = nn.Embedding(vocab_size + 1, E)
        self.init_h = nn.Linear(feat_dim, H)
        self.gru1 = nn.GRUCell(E, H)
        self.attention = CoverageAttention(
            H,
            feat_dim,
            A.dim,
            A.coverage_channels,
            A.coverage_kernel,
            A.stable,
            A.position_features,
        )
        self.gru2 = nn.GRUCell(feat_dim, H)
        # WAP's readout is Linear(h) + Linear(emb) + Linear(context): one Linear over the concatenation is the same.
        self.readout = nn.Linear(H + E + feat_dim, E)
        self.drop = nn.Dropout(cfg.dropout)
        self.out = nn.Linear(E // 2, vocab_size)

    def init_state(self, features: Tensor, feat_mask: Tensor) -> DecoderState:
        """h0 = tanh(Linear(mean of the valid annotations)), as WAP; features (B, C, h, w), feat_mask (B, h, w)."""
        B, C, h, w = features.shape
        flat = features.flatten(2).transpose(1, 2)  # (B, L, C)
        m = feat_mask.reshape(B, h * w, 1).to(flat.dtype)
        mean = (flat * m).sum(1) / m.sum(1).clamp_min(1.0)  # (B, C)
        return DecoderState(
            h=torch.tanh(self.init_h(mean)),
            # At least float32: under bf16 autocast 1.0 + 0.003 rounds back to 1.0 and coverage would stop growing.
            coverage=features.new_zeros(B, h, w, dtype=torch.promote_types(features.dtype, torch.float32)),
            features=flat,
            proj=self.attention.project_features(flat, (h, w)),
            mask=feat_mask.to(features.dtype),
        )

    def recur(self, state: DecoderState, emb: Tensor) -> tuple[Tensor, Tensor, DecoderState, Tensor]:
        """The recurrent half of a step: h_t, context (B, C), the new state and alpha (B, h, w)."""
        h_tilde = self.gru1(emb, state.h)  # (B, H)
        context, alpha = self.attention(h_tilde, state.features, state.proj, state.mask, state.coverage)
        h = self.gru2(context, h_tilde)  # (B, H)
        return (
            h,
            context,
            replace(state, h=h, coverage=state.coverage + alpha),
            alpha,
        )

    def readout_logits(self, h: Tensor, emb: Tensor, context: Tensor) -> Tensor:
        """WAP's maxout readout, for one step (B, .) or for all steps at once (B, T, .): logits (..., V)."""
        r = self.readout(torch.cat([h, emb, context], -1))  # (..., E)
        r = r.view(*r.shape[:-1], -1, 2).amax(-1)  # (..., E/2) maxout over pairs, WAP's readout
        return self.out(self.drop(r))

    def step(self, state: DecoderState, emb: Tensor) -> tuple[Tensor, DecoderState, Tensor]:
        """One decoding step from the previous token's embedding (B, E): logits (B, V), new state, alpha (B, h, w)."""
        h, context, new, alpha = self.recur(state, emb)
        return self.readout_logits(h, emb, context), new, alpha


class TrainOutputs(NamedTuple):
    """What a teacher-forced forward returns when asked for more than logits (see WAP.forward)."""

    logits: Tensor  # (B, T, V)
    counts: Tensor | None  # (B, V), the counting head's symbol counts
    alphas: Tensor | None  # (B, T, h, w), every step's attention
    symbols: (
        tuple[Tensor, Tensor] | None
    )  # the symbol map's logits (B, V, h, w) and the annotations' mask (B, h, w)


class WAP(nn.Module):
    """Watcher (VGG or DenseNet encoder) + Parser (coverage-attention conditional GRU)."""

    select_state = staticmethod(select_state)

    def __init__(
        self,
        watcher: nn.Module,
        parser: Parser,
        vocab_size: int,
        counting: float = 0.0,
        guide: dict | None = None,
        symbol_map: float = 0.0,
        label_smoothing: float = 0.0,
        symbol_readout: bool = False,
    ):
        super().__init__()
        self.watcher = watcher
        self.parser = parser
        self.vocab_size = vocab_size
        self.start_index = vocab_size  # the extra embedding row
        # CAN's counting head (model.counting > 0): per-position symbol densities, used in training only.
        self.counting_weight = float(counting)
        self.counter = nn.Conv2d(watcher.out_channels, vocab_size, 1) if counting > 0 else None
        if self.counter is not None:  # start near "no symbol here" (sigmoid(-4) = 0.018), not 0.5 everywhere
            nn.init.constant_(self.counter.bias, -4.0)
        # The symbol map (model.symbol_map > 0): each annotation classified as a symbol or background (row 0, the
        # <eol> row, which no box names), trained on the symbol boxes; in training only, like the counting head.
        self.symbol_map_weight = float(symbol_map)
        self.symbol_head = nn.Conv2d(watcher.out_channels, vocab_size, 1) if symbol_map > 0 else None
        # The attention guide (model.attention.guide with a weight > 0): a training loss only, no parameters;
        # wapstable.model.loss reads it, and leaves its last unweighted value in guide_value for the logs.
        self.guide = guide
        self.guide_value: Tensor | None = None
        self.symbol_map_value: Tensor | None = None  # the symbol map's last unweighted loss, for the logs
        self.label_smoothing = float(label_smoothing)  # of the training loss (wapstable.model.loss); 0 = off
        # The symbol readout (model.symbol_readout): each step's output logits also get the symbol map's
        # log-probabilities averaged under that step's attention, so the map reads the symbol the parser looks at;
        # the background row adds nothing to <eol>. Used in training and decoding alike; without the map
        # (model.symbol_map=0) it is off.
        self.symbol_readout = bool(symbol_readout) and self.symbol_head is not None

    def output_layer_names(self) -> list[str]:
        """Dotted names of the output layer's parameters (adaptive gradient clipping leaves them alone)."""
        names = [f"parser.out.{n}" for n, _ in self.parser.out.named_parameters()]
        for name in ("counter", "symbol_head"):
            head = getattr(self, name)
            if head is not None:
                names += [f"{name}.{n}" for n, _ in head.named_parameters()]
        return names

    def scale_energies(self, scale: float) -> None:
        """Multiply the attention energies by `scale` until told otherwise (the attention_overflow fault; 1 = off)."""
        self.parser.attention.energy_scale = scale

    def encode(self, images: Tensor, image_mask: Tensor) -> tuple[Tensor, Tensor]:
        """images (B, 1, H, W), image_mask (B, H, W) -> features (B, C, h, w) (0 on padding), feat_mask (B, h, w)."""
        m = image_mask.to(images.dtype).unsqueeze(1)  # (B, 1, H, W)
        features, m = self.watcher(images * m, m)
        return features, m.squeeze(1)

    def init_state(self, features: Tensor, feat_mask: Tensor) -> DecoderState:
        """The parser's state before the first token."""
        state = self.parser.init_state(features, feat_mask)
        if self.symbol_readout:
            state = replace(state, symbols=self.symbol_log_probs(self.symbol_head(features)))
        return state

    def symbol_log_probs(self, symbol_logits: Tensor) -> Tensor:
        """The symbol map's log-probabilities over the vocabulary, (B, V, h, w), float32, with row 0 set to 0: the
        map's row 0 is background, not the end of the expression, so the readout adds nothing to <eol>."""
        log_probs = F.log_softmax(symbol_logits.float(), 1)
        return torch.cat([torch.zeros_like(log_probs[:, :1]), log_probs[:, 1:]], 1)

    def read_symbols(self, alphas: Tensor, maps: Tensor) -> Tensor:
        """The symbol readout: `maps` of symbol_log_probs (B, V, h, w) averaged under attention `alphas`
        (B, T, h, w): (B, T, V)."""
        return torch.einsum("bthw,bvhw->btv", alphas.float(), maps)

    def step(self, state: DecoderState, prev_tokens: Tensor) -> tuple[Tensor, DecoderState, Tensor]:
        """Decode one token: prev_tokens (B,) -> log_probs (B, V), new state, alpha (B, h, w)."""
        logits, state, alpha = self.parser.step(state, self.parser.embed(prev_tokens))
        logits = logits.float()
        if state.symbols is not None:
            logits = logits + self.read_symbols(alpha.unsqueeze(1), state.symbols).squeeze(1)
        return F.log_softmax(logits, -1), state, alpha

    def count(self, features: Tensor, feat_mask: Tensor) -> Tensor:
        """CAN's symbol counts: sigmoid densities of the counting head summed over the valid positions, (B, V)."""
        density = torch.sigmoid(self.counter(features).float()) * feat_mask.unsqueeze(1).float()
        return density.sum((2, 3))

    def forward(
        self,
        images: Tensor,
        image_mask: Tensor,
        targets: Tensor,
        target_mask: Tensor | None = None,
        with_counts: bool = False,
        with_alphas: bool = False,
        with_symbols: bool = False,
    ) -> Tensor | tuple:
        """Teacher-forced logits (B, T, V): step t reads targets[:, t-1] (the start token at t=0).

        targets (B, T) end with `<eol>` = 0 and are padded after it; `target_mask` (B, T) is accepted for a uniform
        call but not needed: the parser is causal, so steps past the end change nothing before it, and the loss
        drops them. `with_counts` (a model with a counting head) also returns the predicted symbol counts (B, V).
        `with_alphas` or `with_symbols` return TrainOutputs(logits, counts, alphas, symbols), the ones not asked for
        None: alphas (B, T, h, w) are every step's attention, for the attention guide; symbols are the symbol map's
        logits (B, V, h, w) and the annotations' mask (B, h, w), for the symbol-map loss.
        """
        features, feat_mask = self.encode(images, image_mask)
        counts = self.count(features, feat_mask) if with_counts and self.counter is not None else None
        symbols = None
        if (with_symbols or self.symbol_readout) and self.symbol_head is not None:
            symbols = (self.symbol_head(features), feat_mask)
        state = self.parser.init_state(features, feat_mask)
        start = targets.new_full((targets.size(0), 1), self.start_index)
        emb = self.parser.embed(torch.cat([start, targets[:, :-1]], 1))  # (B, T, E)
        hs, contexts, alphas = [], [], []
        for t in range(targets.size(1)):
            h, context, state, alpha = self.parser.recur(state, emb[:, t])
            hs.append(h)
            contexts.append(context)
            if with_alphas or self.symbol_readout:
                alphas.append(alpha)
        # The readout feeds nothing back into the recurrence, so teacher forcing runs it once over all steps:
        # the same logits as step() gives, with a third fewer ops in the per-token loop.
        logits = self.parser.readout_logits(torch.stack(hs, 1), emb, torch.stack(contexts, 1))
        if self.symbol_readout:
            logits = logits.float() + self.read_symbols(
                torch.stack(alphas, 1), self.symbol_log_probs(symbols[0])
            )
        if with_alphas or with_symbols:
            alphas_out = torch.stack(alphas, 1) if with_alphas else None
            return TrainOutputs(logits, counts, alphas_out, symbols if with_symbols else None)
        return (logits, counts) if with_counts else logits


def build_model(cfg_model, vocab_size: int) -> WAP:
    """The WAP of `cfg_model` (a ModelConfig) for a vocabulary of `vocab_size` tokens (`<eol>` = 0): its watcher built
    from `model.watcher._target_`, the parser and the heads from the rest."""
    c = cfg_model
    watcher = build_watcher(c.watcher)
    for key in ("counting", "symbol_map"):
        if getattr(c, key) < 0:
            raise UserError(f"model.{key}={getattr(c, key)} must be >= 0 (0 turns it off)")
    if not 0 <= c.label_smoothing < 1:
        raise UserError(f"model.label_smoothing={c.label_smoothing} must be in [0, 1) (0 turns it off)")
    g = c.attention.guide
    guide = None
    if float(g.weight) > 0:
        guide = dict(
            weight=float(g.weight), kind=str(g.kind), fade_start=int(g.fade_start), fade_end=int(g.fade_end)
        )
    return WAP(
        watcher,
        Parser(c, watcher.out_channels, vocab_size),
        vocab_size,
        counting=float(c.counting),
        guide=guide,
        symbol_map=float(c.symbol_map),
        label_smoothing=float(c.label_smoothing),
        symbol_readout=bool(c.symbol_readout),
    )
