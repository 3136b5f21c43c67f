"""The typed config schema: dataclasses registered in Hydra's ConfigStore.

Every YAML file under `conf/` is merged onto these classes, so a typo in a key or a value of the wrong type fails
before anything runs, with OmegaConf's message naming the key. Only this module, the entry points and the build
step (`hydra.utils.instantiate` of `optim._target_`) import Hydra.
The YAML files ship inside the package (`wapstable/conf`, which in a checkout is a link to the top-level `conf/`),
so an installed `wapstable-train` composes the same configs as `python train.py` in a checkout.
"""

import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from wapstable.data.schema import (
    CrohmeData,
    DataConfig,
    SyntheticData,
    data_schema,
    nest_batch_keys,
    owned_keys_only,
)

CONF_DIR = Path(__file__).parent / "conf"  # config.yaml and one folder per config group


# Keys with a fixed set of values. OmegaConf checks them when a config is composed, loaded from a checkpoint or
# overridden (`Invalid value 'x', expected one of [...]`, naming the key), so no module checks them again. A value
# reads as the plain string: `cfg.data.on_error == "skip"`, and checkpoints store strings (`enum_to_str=True`).
OnBudgetExhausted = StrEnum("OnBudgetExhausted", "stop rollback")
FaultName = StrEnum("FaultName", "none nan_input inf_loss lr_spike attention_overflow preempt")
GuideKind = StrEnum("GuideKind", "inside kl")


@dataclass
class GuideConfig:
    """Attention guidance: a training loss that pulls each decoding step's attention toward the box of the symbol
    its target token names (the data's symbol boxes, on the annotation grid); tokens without a box are skipped."""

    weight: float = 0.0  # its weight beside the sequence loss; 0 = off (the default)
    # inside: -log of the attention mass on the cells the box touches; kl: KL(target || attention), the target
    # being the box's share of each cell
    kind: GuideKind = GuideKind.inside
    # the weight falls linearly from `weight` at step fade_start to 0 at step fade_end; fade_end=0: it never fades
    fade_start: int = 0
    fade_end: int = 0


@dataclass
class AttentionConfig:
    dim: int = 64  # attention dim (VGG WAP: 128, DenseWAP: 512)
    coverage_channels: int = 32  # channels of the coverage conv over the summed past alphas
    coverage_kernel: int = 5  # VGG WAP: 5x5, DenseWAP: 11x11
    stable: bool = True  # subtract the per-sample max before exp; false = the original naive formula
    # 2-D sinusoidal positions of the annotation grid added to the attention keys (U a_i + P pos_i); 0 = off
    # (WAP as published). The parser then knows where each annotation is, not only what it holds.
    position_features: int = 0
    guide: GuideConfig = field(default_factory=GuideConfig)


@dataclass
class ModelConfig:
    name: str = "small"
    # The encoder: its `_target_` (a watcher class of wapstable/model/watchers/, or of the user's own) and that
    # watcher's options (its `Options` dataclass types them): conf/model/NAME.yaml.
    watcher: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "wapstable.model.watchers.vgg.VGGWatcher"}
    )
    embed_dim: int = 64
    hidden_dim: int = 128
    dropout: float = 0.0
    # Weight of an auxiliary symbol-counting loss on the watcher's features, as in CAN (Li et al. 2022): a 1x1 conv
    # maps each annotation to per-symbol densities whose sum over the image is regressed on the label's symbol
    # counts. It teaches the watcher to find every symbol from the first step; decoding does not use it. 0 = off.
    counting: float = 0.0
    # Weight of the symbol map (docs/studies/guidance.md): a 1x1 conv over the watcher's annotations classifies each cell as
    # the symbol whose box covers it (or background), trained on the data's symbol boxes, so the watcher learns
    # what each symbol looks like from every cell of every image instead of only through the parser's loss.
    # Decoding uses it only through model.symbol_readout; batches without boxes skip its loss. 0 = off.
    symbol_map: float = 0.0
    # Label smoothing of the sequence loss (Szegedy et al. 2016): each token's target keeps 1 - eps of its mass
    # and spreads eps over the vocabulary. 0 = off, WAP's plain negative log-likelihood.
    label_smoothing: float = 0.0
    # The symbol readout (docs/studies/guidance.md): each decoding step's logits also get the symbol map's log-probabilities
    # averaged under its attention. Off without the map (model.symbol_map=0); used in decoding too.
    symbol_readout: bool = False
    attention: AttentionConfig = field(default_factory=AttentionConfig)


@dataclass
class OptimConfig:
    # The optimizer class, built by hydra.utils.instantiate with the keys below that its constructor takes.
    _target_: str = "torch.optim.Adadelta"
    name: str = "adadelta"  # the option's name, in logs and in the resume check
    lr: float = 1.0
    rho: float = 0.95
    eps: float = 1e-6
    weight_decay: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    momentum: float = 0.0
    # a built-in schedule's name (constant | cosine | step: wapstable/train/schedules/, taking the keys below), or a
    # node {_target_: your.Schedule, KEY: value}; checked in train.build
    schedule: Any = "constant"
    warmup_steps: int = 0
    step_size: int = 1000
    gamma: float = 0.5
    min_lr_ratio: float = 0.0


@dataclass
class GuardConfig:
    skip_nonfinite: bool = True
    max_consecutive_skips: int = 5
    max_total_skips: int = 1000
    skip_spikes: bool = False
    spike_window: int = 128
    spike_zscore: float = 6.0
    spike_warmup: int = 32
    detect_anomaly: bool = False
    checkpoint_on_anomaly: bool = True
    max_anomaly_checkpoints: int = 3
    localize: bool = True
    on_budget_exhausted: OnBudgetExhausted = OnBudgetExhausted.stop
    snapshot_every: int = 50  # also at every regular checkpoint; 0 = only there
    lr_backoff: float = 0.5
    clip_backoff: float = 0.5
    max_rollbacks: int = 3


@dataclass
class FaultConfig:
    name: FaultName = FaultName.none
    step: int = 5
    steps: int = 1  # how many consecutive steps the fault fires
    rank: int = 0
    scale: float = 1e4  # attention_overflow: energy multiplier; lr_spike: lr multiplier


@dataclass
class StatsConfig:
    every: int = 50  # grad_stats.csv rows every N steps (0 = off; anomalous steps are always written)
    histogram_every: int = 500  # TensorBoard histograms of gradients and weights (0 = off)
    attention_images: int = 4  # validation samples drawn with their attention at each evaluation (0 = off)
    csv: bool = True  # false: no grad_stats.csv at all, not even anomalous steps


@dataclass
class DecodeConfig:
    beam_size: int = 1  # 1 = greedy; used by the evaluations during training
    max_len: int = 100
    # the final test evaluation: beam 10 as in WAP; costs about 20-30 s more than greedy on the default run's 200
    # test images on a CPU (about 2% of the run)
    final_beam_size: int = 10
    # the final test evaluation (and scripts/evaluate.py) reads every image at each of these scales, resized, and
    # keeps the reading of highest log-prob / length; [1.0] reads it as it is (docs/studies/handwriting.md, "Reading at
    # several sizes")
    scales: list[float] = field(default_factory=lambda: [1.0])
    # beam search (and decode.scales) picks the reading of highest log-prob / length ** length_power: 1 as WAP
    # (length-normalised), 0 the plain log-prob (shorter readings favoured), between the two a compromise
    length_power: float = 1.0


@dataclass
class PretrainConfig:
    # > 0: before the run, train the same model this many steps on the rendered data (data=synthetic's defaults,
    # the run's optimizer) in RUN_DIR/pretrain, and start the run from its best checkpoint (as init_from=)
    steps: int = 0
    eval_every: int = 500
    # the rendered data as composed (conf/config.yaml puts conf/data/synthetic.yaml here), and data.KEY values on
    # top of it
    rendered: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    # > 0: this many rendered training expressions of that data (pretrain.data) join a real data set's training
    # split, beside its own (the validation labels left out); with or without pretrain.steps
    mix: int = 0
    # true: the pretraining's own training time (its metrics.json wall_time_s) counts against trainer.max_minutes,
    # so that the budget bounds the pretraining and the training together; the run trains for what is left
    in_budget: bool = False


@dataclass
class TrainerConfig:
    max_steps: int = 3000
    # Wall-clock budget of the training loop in minutes (0 = none): training stops at max_steps or when the budget
    # is spent, whichever comes first, and a cosine schedule follows whichever runs out first. Not part of a
    # bit-identical run: where it stops depends on the machine's speed.
    max_minutes: float = 0.0
    eval_every: int = 500
    checkpoint_every: int = 500
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "32"  # 32 | bf16 | fp16 (checked in train.build: "32" cannot name an Enum member)
    ddp: bool = False
    consistency_every: int = 100
    progress: bool = True
    # torch intra-op threads: auto = the cores this process may use divided by the processes sharing them
    # (torchrun's ranks, a joblib sweep's parallel jobs); a number; 0 = torch's default (every core)
    threads: int | str = "auto"
    # An exponential moving average of the weights, the model that validation, best.pt, the test and inference read
    # (wapstable/train/ema.py): its decay per applied step, e.g. 0.999; 0 = off
    ema_decay: float = 0.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # The clip rule: its `_target_` (a class of wapstable/stability/clip/, or of the user's own) and that rule's
    # options (conf/clip/NAME.yaml); the rule is a dataclass that types and checks its own options
    # (stability/clip: build_clip).
    clip: dict[str, Any] = field(
        default_factory=lambda: {"_target_": "wapstable.stability.clip.norm.NormClip"}
    )
    guard: GuardConfig = field(default_factory=GuardConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    # The loggers a run writes to, by name: each an object with its `_target_` (a class of
    # wapstable/train/loggers.py, or of the user's own) and that class's options (conf/logger/NAME.yaml). Each class
    # checks its own options (its `Options` dataclass): train/loggers.py's check_logger_config.
    logger: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    resume: str | None = None  # PATH to a checkpoint, or "auto" for the run directory's last.pt
    # PATH to a checkpoint whose weights start this run (only the weights: a fresh optimizer, step 0); token rows
    # are matched by name, so a model of the rendered data can start a CROHME run
    init_from: str | None = None
    optimize_metric: str = "best_valid_exprate"
    run_dir: str = "${hydra:runtime.output_dir}"


# Tiny data and model for smoke runs (the tests, `scripts/bench.py --quick`): a run of train.py takes seconds. The
# values are in conf/debug/tiny.yaml.
TINY_OVERRIDES = ["debug=tiny"]


def quote_group_options(args: list[str]) -> list[str]:
    """Quote `inf` where it names a clip mode (`clip=inf`): Hydra's override grammar reads a bare `inf` as a float,
    so `clip=inf` would fail with "Config group override must be a string"."""
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") == "clip":
            value = re.sub(r"(?<![\w'\"])inf(?![\w'\"])", "'inf'", value)
        out.append(key + sep + value)
    return out


def register_configs() -> None:
    """Register the schema so that `conf/config.yaml` and every group file are checked against it."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    # each built-in source's keys, named first in its conf/data/NAME.yaml (`/schema/data/NAME@_here_`)
    cs.store(group="schema/data", name="synthetic", node=SyntheticData)
    cs.store(group="schema/data", name="crohme", node=CrohmeData)


# optim.name -> optim._target_ for the checkpoints written before the optimizer was a `_target_`.
LEGACY_OPTIMIZERS = {"adadelta": "torch.optim.Adadelta", "adam": "torch.optim.Adam", "sgd": "torch.optim.SGD"}


# logger.NAME -> logger.NAME._target_ for the checkpoints written before the loggers were `_target_`s.
LEGACY_LOGGERS = {
    name: f"wapstable.train.loggers.{cls}"
    for name, cls in (
        ("tensorboard", "TensorBoardLogger"),
        ("csv", "CsvLogger"),
        ("mlflow", "MlflowLogger"),
        ("wandb", "WandbLogger"),
    )
}


def data_yaml(name: str) -> DictConfig:
    """conf/data/NAME.yaml as it is, on the schema of the source it names (its defaults list left out)."""
    own = OmegaConf.load(CONF_DIR / "data" / f"{name}.yaml")
    own.pop("defaults", None)
    return typed_data(own)


def rendered_defaults() -> DictConfig:
    """conf/data/synthetic.yaml: the rendered data of a config composed before pretrain.rendered was."""
    return data_yaml("synthetic")


def typed_data(data) -> DictConfig:
    """A data config (a dict or a DictConfig) on the schema of the source its `_target_` names: its own keys and the
    shared ones typed and checked, a key of another source refused (OmegaConf's error naming it)."""
    return OmegaConf.merge(OmegaConf.structured(data_schema(data.get("_target_"))), data)


def checkpoint_config(saved: dict, keys: list[str], source: DictConfig) -> DictConfig:
    """A checkpoint's config in this version's schema (its run_dir and resume dropped), with each of `keys` taken
    from `source` (the command line's composed config): whole groups first, then single keys on top. Used by a
    resumed run and by scripts/evaluate.py; raises OmegaConf's error when the saved config does not fit."""
    saved = {k: v for k, v in saved.items() if k not in ("run_dir", "resume")}
    saved.setdefault("logger", {"tensorboard": {}})  # checkpoints from before the logger group: TensorBoard
    loggers = saved["logger"]
    if isinstance(
        loggers, dict
    ):  # checkpoints from before logger.NAME._target_: the class that name built then
        saved["logger"] = {
            name: {"_target_": LEGACY_LOGGERS[name], **opts}
            if isinstance(opts, dict) and "_target_" not in opts and name in LEGACY_LOGGERS
            else opts
            for name, opts in loggers.items()
            if opts is not None  # the old schema kept every logger, None where not chosen
        }
    if isinstance(saved.get("data"), dict):  # from before data.batch
        saved["data"] = nest_batch_keys(saved["data"])
    if isinstance(saved.get("pretrain"), dict):
        pretrain = {**saved["pretrain"]}
        for k in ("data", "rendered"):
            if k in pretrain:
                pretrain[k] = nest_batch_keys(pretrain[k])
        if pretrain.get("rendered"):  # from before the sources owned their keys: every source's
            pretrain["rendered"] = owned_keys_only(pretrain["rendered"])
        saved["pretrain"] = pretrain
    if isinstance(saved.get("data"), dict) and "_target_" not in saved["data"]:  # from before data._target_
        from wapstable.data.sources import legacy_data

        saved["data"] = legacy_data(saved["data"])
    if isinstance(saved.get("model"), dict) and not isinstance(saved["model"].get("watcher", {}), dict):
        from wapstable.model.watchers import legacy_watcher  # from before model.watcher._target_

        saved["model"] = legacy_watcher(saved["model"])
    if isinstance(saved.get("clip"), dict) and "_target_" not in saved["clip"]:  # from before clip._target_
        from wapstable.stability.clip import legacy_clip

        saved["clip"] = legacy_clip(saved["clip"])
    pretrain = saved.get("pretrain")
    if isinstance(pretrain, dict) and not pretrain.get(
        "rendered"
    ):  # from before pretrain.rendered was composed
        saved["pretrain"] = {**pretrain, "rendered": OmegaConf.to_container(rendered_defaults())}
    optim = saved.get("optim")
    if isinstance(optim, dict) and "_target_" not in optim:  # checkpoints from before optim._target_
        saved["optim"] = {**optim, "_target_": LEGACY_OPTIMIZERS.get(optim.get("name"), OptimConfig._target_)}
    merged = OmegaConf.structured(Config)
    # the data on its source's schema, other sources' keys dropped (before the sources owned their keys, every
    # config held them all)
    if isinstance(saved.get("data"), dict):
        saved["data"] = owned_keys_only(saved["data"])
        merged.data = OmegaConf.structured(data_schema(saved["data"].get("_target_")))
    merged = OmegaConf.merge(merged, saved)
    for key in sorted(keys, key=lambda k: "." in k):
        OmegaConf.update(merged, key, OmegaConf.select(source, key), merge=False)
    return merged
