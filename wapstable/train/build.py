"""Config -> components: the one place where a run's config is read, checked and turned into the objects a run is
made of (data, model, optimizer and schedule, the guard and its helpers). Every check here runs before any file of
the run directory is written; each failure is one `UserError` sentence naming the key to change.

The components themselves take plain values (the guard, the clip helpers, the data stream) or their own small
config node (the model, the optimizer, the data source), so a loop of your own can build them without this module.
"""

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from wapstable.checkpoint import inference_weights, load_checkpoint
from wapstable.config import Config, checkpoint_config, rendered_defaults, typed_data
from wapstable.data.batches import BatchStream, check_labels, filter_samples, load_splits, load_vocab
from wapstable.data.normalize import InkStats, check_read_range
from wapstable.data.pixel_aug import check_pixel_aug
from wapstable.data.sources import source_of
from wapstable.data.sources.mix import MixSource
from wapstable.data.vocab import Vocab
from wapstable.errors import UserError
from wapstable.eval.evaluation import check_length_power, check_scales
from wapstable.model.wap import build_model
from wapstable.stability.clip import build_clip
from wapstable.stability.gradstats import validate_stats_config
from wapstable.train.loggers import check_logger_config
from wapstable.train.schedules import build_schedule

log = logging.getLogger("wapstable")


def validate_config(cfg: DictConfig) -> None:
    """Fail fast, before any file is written, on values the schema's types and Enums cannot catch (ranges, and
    combinations of keys)."""
    t = cfg.trainer
    for key in ("max_steps", "eval_every", "checkpoint_every", "log_every"):
        if t[key] <= 0:
            raise UserError(f"trainer.{key}={t[key]} must be a positive number of steps")
    if t.max_minutes < 0:
        raise UserError(f"trainer.max_minutes={t.max_minutes} must be >= 0 (0 = no time limit)")
    if not 0 <= t.ema_decay < 1:
        raise UserError(
            f"trainer.ema_decay={t.ema_decay} must be in [0, 1): the weight the average keeps per step, 0 for none"
        )
    if t.precision not in ("32", "bf16", "fp16"):
        raise UserError(f"trainer.precision={t.precision!r} is unknown; use 32, bf16 or fp16")
    build_clip(cfg.clip)  # the rule checks its own options
    build_schedule(cfg.optim)  # and so does the schedule
    source_of(cfg.data)  # the data source, and its own options
    validate_stats_config(cfg.stats)
    check_logger_config(cfg.logger)
    g = cfg.guard
    if g.max_consecutive_skips < 0 or g.max_total_skips < 0:
        raise UserError("guard.max_consecutive_skips and guard.max_total_skips must be >= 0")
    if g.snapshot_every < 0 or g.max_rollbacks < 0:
        raise UserError(
            "guard.snapshot_every and guard.max_rollbacks must be >= 0 (snapshot_every=0: snapshots only at "
            "checkpoints)"
        )
    if not (0 < g.lr_backoff <= 1 and 0 < g.clip_backoff <= 1):
        raise UserError("guard.lr_backoff and guard.clip_backoff must be in (0, 1]: a rollback lowers them")
    validate_guide_config(cfg)
    d = cfg.data
    mix = OmegaConf.select(cfg, "pretrain.mix", default=0)
    if mix < 0:
        raise UserError(
            f"pretrain.mix={mix} must be >= 0 (0 = no rendered expressions in the training split)"
        )
    if mix > 0 and d.name == "synthetic":
        raise UserError(
            "pretrain.mix adds rendered expressions to a real data set's training split, and data=synthetic is "
            "rendered already; set pretrain.mix=0 or raise data.num_train"
        )
    if d.batch.curriculum_epochs < 0:
        raise UserError(
            f"data.batch.curriculum_epochs={d.batch.curriculum_epochs} must be >= 0 (0 = no curriculum)"
        )
    if not d.get("warp", 0) >= 0:
        raise UserError(f"data.warp={d.warp} must be >= 0 (0 turns the per-step warp off)")
    if d.get("pixel_aug") is not None:
        check_pixel_aug(d.pixel_aug)
    if d.get("read_range") is not None:
        check_read_range(d.read_range)
    if d.get("redraw", 0) < 0 or not d.get("redraw_strength", 1.0) >= 0:
        raise UserError(
            f"data.redraw={d.redraw} and data.redraw_strength={d.redraw_strength} must be >= 0 (data.redraw=0 "
            "trains on each file as written; data.redraw=2 adds two more drawings of each, in other hands)"
        )
    if d.batch.pixel_budget <= 0 or d.batch.max_batch <= 0:
        raise UserError("data.batch.pixel_budget and data.batch.max_batch must be positive")
    if cfg.decode.max_len <= 0 or cfg.decode.beam_size <= 0 or cfg.decode.final_beam_size <= 0:
        raise UserError("decode.max_len, decode.beam_size and decode.final_beam_size must be positive")
    check_scales(cfg.decode.scales)
    check_length_power(cfg.decode.length_power)


def validate_guide_config(cfg: DictConfig) -> None:
    """model.attention.guide: a weight >= 0 and a fade that ends after it starts; model.symbol_map >= 0; a warning
    when either is on and the data has no symbol boxes (it then adds nothing); model.label_smoothing in [0, 1). The
    symbol readout goes with the map: model.symbol_map=0 turns both off."""
    smoothing = OmegaConf.select(cfg, "model.label_smoothing", default=0.0)
    if not 0 <= smoothing < 1:
        raise UserError(f"model.label_smoothing={smoothing} must be in [0, 1) (0 turns it off)")
    guide = OmegaConf.select(cfg, "model.attention.guide")
    if guide is None:
        return
    if not guide.weight >= 0:
        raise UserError(f"model.attention.guide.weight={guide.weight} must be >= 0 (0 turns the guide off)")
    if guide.fade_start < 0:
        raise UserError(f"model.attention.guide.fade_start={guide.fade_start} must be a step >= 0")
    if guide.fade_end < 0 or 0 < guide.fade_end <= guide.fade_start:
        raise UserError(
            f"model.attention.guide.fade_end={guide.fade_end} must be 0 (no fade) or a step after "
            f"model.attention.guide.fade_start={guide.fade_start}"
        )
    symbol_map = OmegaConf.select(cfg, "model.symbol_map", default=0.0)
    if not symbol_map >= 0:
        raise UserError(f"model.symbol_map={symbol_map} must be >= 0 (0 turns the symbol map off)")
    boxes = source_of(cfg.data).boxes  # the sources whose samples carry symbol boxes
    if symbol_map > 0 and not boxes:
        log.warning(
            "model.symbol_map=%s does nothing on data=%s, which has no symbol boxes (data=synthetic and data=crohme "
            "have them); set model.symbol_map=0 to say so",
            symbol_map,
            cfg.data.name,
        )
    if guide.weight > 0 and not boxes:
        log.warning(
            "model.attention.guide.weight=%s does nothing on data=%s, which has no symbol boxes (data=synthetic "
            "and data=crohme have them); set model.attention.guide.weight=0 to say so",
            guide.weight,
            cfg.data.name,
        )


def resolve_resume(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The checkpoint to resume from: resume=PATH, or for resume=auto the run's last.pt when there is one."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        last = run_dir / "checkpoints" / "last.pt"
        if last.is_file():
            return last
        log.info("resume=auto: no %s yet, starting fresh", last)  # a restarted job's log says which it did
        return None
    return Path(cfg.resume).expanduser()


def effective_config(cfg: DictConfig, saved: dict, overrides: list[str]) -> DictConfig:
    """The checkpoint's config with this command line's overrides on top (they win), as a resumed run uses."""
    keys = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("hydra") or key in ("resume", "run_dir"):
            continue
        if "." not in key and key not in Config.__dataclass_fields__:
            # A preset of the _global_ package (debug=tiny, experiment=...): no key of its own; what it set is in
            # the checkpoint's config already, when the run was started with it.
            continue
        keys.append(key)
    merged = checkpoint_config(saved, keys, cfg)
    merged.resume, merged.run_dir = cfg.resume, cfg.run_dir
    return merged


def load_resume(cfg: DictConfig, run_dir: Path, overrides: list[str] | None):
    """(config, state, path) of the run to continue; (cfg, None, None) for a fresh run. With `overrides` (the
    command line's), the checkpoint's config is the base and they are applied on top."""
    path = resolve_resume(cfg, run_dir)
    if path is None:
        return cfg, None, None
    state = load_checkpoint(path)
    if "config" not in state or "model" not in state:
        raise UserError(f"{path} is a checkpoint without a training state; it cannot be resumed")
    if overrides is not None:
        cfg = effective_config(cfg, state["config"], overrides)
    log.info("resuming from %s (step %d)", path, state["step"])
    return cfg, state, path


def pretrain_data(cfg: DictConfig) -> DictConfig:
    """The rendered data of pretrain.steps and pretrain.mix: pretrain.rendered (data=synthetic as Hydra composed it)
    with pretrain.data's keys on top, in the run's cache; with glyphs=crohme, the symbols are cut from the run's own training folder (data.root,
    data.train, its validation hold-out excluded) unless pretrain.data names another."""
    p = cfg.pretrain
    data = OmegaConf.merge(typed_data(p.rendered or rendered_defaults()), p.data)
    data.cache_dir = cfg.data.cache_dir
    if str(data.glyphs) == "crohme":
        take_run_keys(data, cfg, ("root", "train", "valid_fraction"))
    return data


def take_run_keys(data: DictConfig, cfg: DictConfig, keys) -> None:
    """Copy the run's data.KEY onto the rendered data's `data` for each of `keys` that pretrain.data does not set."""
    for key in keys:
        if key not in cfg.pretrain.data:
            data[key] = cfg.data[key]


def mixed_source(cfg: DictConfig) -> MixSource | None:
    """pretrain.mix > 0: the run's data source combined with that many rendered training expressions of the
    pretraining's data (pretrain_data), drawn with the run's raster (data.scale, height, symbol_size, line_width,
    unless pretrain.data sets them); None otherwise."""
    n = OmegaConf.select(cfg, "pretrain.mix", default=0)
    if n <= 0:
        return None
    data = pretrain_data(cfg)
    data.num_train = n
    take_run_keys(
        data, cfg, ("scale", "height", "symbol_size", "line_width")
    )  # drawn as the run's own images are
    return MixSource(data, prefix="rendered-", what="pretrain.mix", kind="rendered")


def build_data(cfg: DictConfig, resume_state: dict | None) -> tuple[dict, Vocab]:
    """The three splits, checked against the vocabulary (the checkpoint's when resuming) and filtered as WAP does;
    with pretrain.mix, rendered expressions join the training split (a MixSource of the two)."""
    d = cfg.data
    ink = InkStats.from_dict(resume_state.get("ink_stats")) if resume_state is not None else None
    splits = load_splits(d, ink=ink, source=mixed_source(cfg))
    vocab = Vocab(list(resume_state["vocab"])) if resume_state is not None else load_vocab(d, splits)
    for split in splits:
        samples = check_labels(splits[split], vocab, d.on_error)
        if split == "train":
            samples = filter_samples(samples, d.batch.max_image_pixels, d.batch.max_tokens)
        if not samples:
            raise UserError(
                f"no {split} sample is left after filtering; raise data.batch.max_image_pixels or data.batch.max_tokens"
            )
        splits[split] = samples
    for folder, reasons in splits.report["skipped"].items():
        if reasons:
            log.warning(
                "%s: skipped %s (data.on_error=skip; the run's data_report.json lists them)",
                folder,
                ", ".join(f"{n} x {why}" for why, n in sorted(reasons.items())),
            )
    log.info(
        "data: %s, %d train / %d valid / %d test samples, vocabulary of %d tokens",
        d.name,
        *(len(splits[s]) for s in ("train", "valid", "test")),
        len(vocab),
    )
    return splits, vocab


def build_stream(cfg: DictConfig, splits: dict, vocab: Vocab, rank: int, world_size: int) -> BatchStream:
    """The endless, resumable stream of training batches (this rank's share under DDP)."""
    d = cfg.data
    return BatchStream(
        splits["train"],
        vocab,
        d.batch.pixel_budget,
        d.batch.max_batch,
        cfg.seed,
        rank=rank,
        world_size=world_size,
        num_workers=d.batch.num_workers,
        bucket_by=d.batch.bucket_by,
        curriculum_epochs=d.batch.curriculum_epochs,
    )


def build_checked_model(
    cfg: DictConfig,
    vocab_size: int,
    device: torch.device,
    resume_state: dict | None,
    resume_path: Path | None,
) -> torch.nn.Module:
    """The configured model on `device`; when resuming, refused unless the checkpoint's weights and optimizer fit."""
    try:
        model = build_model(cfg.model, vocab_size).to(device)
    except ValueError as e:  # a model size that cannot be built: the message names the key
        raise UserError(str(e)) from None
    if resume_state is not None:
        check_model_compatible(model, resume_state["model"], resume_path)
        saved_optim = resume_state["config"].get("optim", {}).get("name")
        if saved_optim and saved_optim != cfg.optim.name:
            raise UserError(
                f"checkpoint {resume_path} holds the state of optimizer {saved_optim}, not "
                f"optim.name={cfg.optim.name}; resume with optim={saved_optim} (its lr and schedule may change)"
            )
    return model


def check_model_compatible(model: torch.nn.Module, state: dict, path: Path) -> None:
    """Refuse a checkpoint whose parameters do not fit this model, naming the first mismatch."""
    own = model.state_dict()
    missing = sorted(set(own) ^ set(state))
    if missing:
        raise UserError(
            f"checkpoint {path} holds another model (parameter {missing[0]} is in one but not the other); "
            "resume with the model config it was trained with"
        )
    for k, v in own.items():
        if tuple(v.shape) != tuple(state[k].shape):
            raise UserError(
                f"checkpoint {path} holds a model of another size ({k}: {tuple(state[k].shape)} there, "
                f"{tuple(v.shape)} here); resume with the model config it was trained with"
            )


# Heads used in training only (model.counting, model.symbol_map): init_from lets them differ between the models.
TRAINING_HEADS = {"counter", "symbol_head"}
# The parameters with one row per token (the embedding has one more, the start token, last).
VOCAB_ROWS = {
    "parser.embed.weight",
    "parser.out.weight",
    "parser.out.bias",
    "counter.weight",
    "counter.bias",
    "symbol_head.weight",
    "symbol_head.bias",
}


def init_from(model: torch.nn.Module, path: str | Path, vocab: Vocab) -> dict:
    """Load the weights of checkpoint `path` into `model` (init_from=CKPT: weights only, no optimizer, step or
    schedule), matching token rows by name when the vocabularies differ: the embedding, output, counting and symbol-map
    rows of a token both vocabularies have are copied, a new token's rows keep their fresh initialisation.

    A training-only head (TRAINING_HEADS) that one model has and the other lacks is no obstacle: a head the
    checkpoint lacks keeps its fresh initialisation, one this model lacks is left out. Refuses (UserError) a
    checkpoint of another model: any other parameter missing, or of another shape beyond the vocabulary's rows.
    Returns what was loaded: {"tensors", "tokens_shared", "tokens_new", "heads_fresh", "heads_dropped"}.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"init_from={path} does not exist; give a checkpoint written by train.py")
    state = load_checkpoint(path)
    if "model" not in state or "vocab" not in state:
        raise UserError(
            f"init_from={path} holds no model weights and vocabulary; give a checkpoint of train.py"
        )
    src_vocab = Vocab(list(state["vocab"]))
    src_rows = {t: i for i, t in enumerate(src_vocab.tokens)}
    pairs = [(i, src_rows[t]) for i, t in enumerate(vocab.tokens) if t in src_rows]
    dst_idx = torch.tensor([i for i, _ in pairs], dtype=torch.long)
    src_idx = torch.tensor([j for _, j in pairs], dtype=torch.long)
    own, saved = model.state_dict(), inference_weights(state)  # the average, where the run kept one
    # A training-only head (the counting head, the symbol map) in one model and not the other is not another model:
    # a head the checkpoint lacks keeps its fresh initialisation, one this model lacks is left behind.
    fresh = sorted({k.split(".")[0] for k in set(own) - set(saved) if k.split(".")[0] in TRAINING_HEADS})
    dropped = sorted({k.split(".")[0] for k in set(saved) - set(own) if k.split(".")[0] in TRAINING_HEADS})
    saved = {k: v for k, v in saved.items() if k.split(".")[0] not in dropped}
    missing = sorted(k for k in set(own) ^ set(saved) if k.split(".")[0] not in fresh)
    if missing:
        raise UserError(
            f"init_from={path} holds another model (parameter {missing[0]} is in one but not the other); "
            "start from a checkpoint of the same model config"
        )
    new = {}
    for key, value in own.items():
        if key not in saved:  # a head the checkpoint lacks
            new[key] = value
            continue
        src = saved[key]
        if key in VOCAB_ROWS and src_vocab != vocab and src.shape[1:] == value.shape[1:]:
            merged = value.clone()  # a new token keeps its fresh rows
            merged[dst_idx] = src[src_idx].to(merged.dtype)
            if key == "parser.embed.weight":  # the start token's row, after the vocabulary
                merged[-1] = src[-1]
            new[key] = merged
        elif src.shape == value.shape:
            new[key] = src
        else:
            raise UserError(
                f"init_from={path} holds a model of another size ({key}: {tuple(src.shape)} there, "
                f"{tuple(value.shape)} here); start from a checkpoint of the same model config"
            )
    model.load_state_dict(new)
    return {
        "tensors": len(new) - sum(k.split(".")[0] in fresh for k in new),
        "tokens_shared": len(pairs),
        "tokens_new": len(vocab) - len(pairs),
        "heads_fresh": fresh,
        "heads_dropped": dropped,
    }
