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

from wapstable.model.attention import CoverageAttention


def _pool_mask(mask: Tensor) -> Tensor:
    """The mask after a 2x2 ceil-mode pool: a cell is valid if any of its pixels is. (B, 1, H, W) -> (B, 1, h, w)"""
    return F.max_pool2d(mask, 2, ceil_mode=True)


def _masked_avg_pool(x: Tensor, mask: Tensor) -> Tensor:
    """2x2 average over valid pixels only, so a border cell half in the padding averages what the image alone has."""
    total = F.avg_pool2d(x * mask, 2, ceil_mode=True, divisor_override=1)  # (B, C, h, w)
    count = F.avg_pool2d(mask, 2, ceil_mode=True, divisor_override=1)  # (B, 1, h, w)
    return total / count.clamp_min(1.0)


class VGGWatcher(nn.Module):
    """WAP's VGG-FCN watcher: blocks of conv3x3 + BN + ReLU, a 2x2 max-pool after each block."""

    def __init__(self, channels: list[int], convs_per_block: int | list[int], pool_last: bool = True):
        super().__init__()
        per_block = [convs_per_block] * len(channels) if isinstance(convs_per_block, int) else convs_per_block
        if len(per_block) != len(channels) or min(per_block, default=1) < 1:
            raise ValueError(
                f"model.block_convs={list(per_block)} must give one count of at least 1 per block of "
                f"model.channels={list(channels)}"
            )
        self.blocks = nn.ModuleList()
        cin = 1
        for cout, n in zip(channels, per_block):
            layers = nn.ModuleList()
            for _ in range(n):
                # No conv bias: the BN right after has its own.
                layers.append(
                    nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))
                )
                cin = cout
            self.blocks.append(layers)
        self.out_channels = cin
        # Without the last block's pool the annotations are twice as fine (stride 8 for 4 blocks), for small symbols.
        self.pool_last = pool_last
        self.stride = 2 ** (len(channels) - (0 if pool_last else 1))

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(B, 1, H, W) image and mask -> (B, C, h, w) features and (B, 1, h, w) mask."""
        for i, block in enumerate(self.blocks):
            for layer in block:
                x = F.relu(layer(x)) * mask
            if i == len(self.blocks) - 1 and not self.pool_last:
                break
            # Post-ReLU values are >= 0, so the zeroed padding never wins the max.
            x = F.max_pool2d(x, 2, ceil_mode=True)
            mask = _pool_mask(mask)
        return x, mask


class DenseLayer(nn.Module):
    """DenseNet-BC bottleneck layer: BN-ReLU-conv1x1(4k)-BN-ReLU-conv3x3(k), its k maps appended to the input."""

    def __init__(self, cin: int, growth: int, dropout: float):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        y = self.conv1(F.relu(self.norm1(x)))  # (B, 4k, h, w); 1x1, so padding leaks nowhere yet
        y = self.conv2(F.relu(self.norm2(y)) * mask)  # (B, k, h, w)
        return torch.cat([x, self.drop(y) * mask], 1)


class DenseWatcher(nn.Module):
    """DenseWAP's watcher (Zhang et al. 2018): conv7x7/2 + max-pool, dense blocks, transitions between them."""

    def __init__(
        self, init_channels: int, growth: int, layers: int, blocks: int, compression: float, dropout: float
    ):
        super().__init__()
        self.stem = nn.Conv2d(1, init_channels, 7, stride=2, padding=3, bias=False)
        self.stem_norm = nn.BatchNorm2d(init_channels)
        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        c = init_channels
        for b in range(blocks):
            block = nn.ModuleList()
            for _ in range(layers):
                block.append(DenseLayer(c, growth, dropout))
                c += growth
            self.blocks.append(block)
            if b < blocks - 1:
                cout = int(c * compression)
                self.transitions.append(
                    nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, cout, 1, bias=False))
                )
                c = cout
        # A final BN + ReLU as torchvision's DenseNet (norm5): the concatenated maps are otherwise unnormalised.
        self.out_norm = nn.BatchNorm2d(c)
        self.out_channels = c  # paper sizes: 48 + 16*24 = 432 -> 216 + 384 = 600 -> 300 + 384 = 684
        self.stride = 4 * 2 ** (blocks - 1)  # stem conv /2, max-pool /2, one avg-pool per transition

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """(B, 1, H, W) image and mask -> (B, C, h, w) features and (B, 1, h, w) mask."""
        # Output j of the stride-2 conv is centred on input 2j, so it is valid where that pixel is.
        mask = mask[:, :, ::2, ::2]
        x = F.relu(self.stem_norm(self.stem(x))) * mask
        x = F.max_pool2d(x, 2, ceil_mode=True)
        mask = _pool_mask(mask)
        for b, block in enumerate(self.blocks):
            for layer in block:
                x = layer(x, mask)
            if b < len(self.transitions):
                x = _masked_avg_pool(self.transitions[b](x), mask)
                mask = _pool_mask(mask)
        return F.relu(self.out_norm(x)) * mask, mask


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
            getattr(A, "position_features", 0),  # absent from older checkpoints' configs
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


def vgg_watcher(c) -> VGGWatcher:
    block_convs = list(getattr(c, "block_convs", None) or [])  # absent from older checkpoints' configs
    pool_last = bool(getattr(c, "pool_last", True))  # absent from older checkpoints' configs
    return VGGWatcher(list(c.channels), block_convs or c.convs_per_block, pool_last)


def dense_watcher(c) -> DenseWatcher:
    return DenseWatcher(
        c.dense_init_channels, c.dense_growth, c.dense_layers, c.dense_blocks, c.dense_compression, c.dropout
    )


# model.watcher -> the encoder it builds (the schema's Watcher Enum lists the same names).
WATCHERS = {"vgg": vgg_watcher, "dense": dense_watcher}


def build_model(cfg_model, vocab_size: int) -> WAP:
    """The WAP of `cfg_model` (a ModelConfig) for a vocabulary of `vocab_size` tokens (`<eol>` = 0)."""
    c = cfg_model
    if c.watcher not in WATCHERS:  # only a config that skipped the schema gets here
        raise ValueError(f"model.watcher must be one of {', '.join(WATCHERS)} (got {c.watcher!r})")
    watcher = WATCHERS[c.watcher](c)
    counting = float(getattr(c, "counting", 0.0) or 0.0)  # absent from older checkpoints' configs
    if counting < 0:
        raise ValueError(f"model.counting={counting} must be >= 0 (0 turns the counting loss off)")
    g = getattr(c.attention, "guide", None)  # absent from older checkpoints' configs
    guide = None
    if g is not None and float(g.weight) > 0:
        guide = dict(
            weight=float(g.weight), kind=str(g.kind), fade_start=int(g.fade_start), fade_end=int(g.fade_end)
        )
    symbol_map = float(getattr(c, "symbol_map", 0.0) or 0.0)  # absent from older checkpoints' configs
    if symbol_map < 0:
        raise ValueError(f"model.symbol_map={symbol_map} must be >= 0 (0 turns the symbol map off)")
    smoothing = float(getattr(c, "label_smoothing", 0.0) or 0.0)  # absent from older checkpoints' configs
    if not 0 <= smoothing < 1:
        raise ValueError(f"model.label_smoothing={smoothing} must be in [0, 1) (0 turns it off)")
    return WAP(
        watcher,
        Parser(c, watcher.out_channels, vocab_size),
        vocab_size,
        counting=counting,
        guide=guide,
        symbol_map=symbol_map,
        label_smoothing=smoothing,
        symbol_readout=bool(getattr(c, "symbol_readout", False)),  # absent from older checkpoints' configs
    )
