"""Watchers (encoders): one module per watcher, each built from `model.watcher._target_` with its own options.

    model:
      watcher:
        _target_: wapstable.model.watchers.vgg.VGGWatcher   # the class; the keys below are its options
        channels: [16, 32, 64, 192]

A watcher is an `nn.Module` that follows the `Watcher` protocol below, with a nested `Options` dataclass that types
its keys (a wrong type or an unknown key is refused naming it, before anything runs); its constructor refuses a value
that cannot work, in one sentence. A new one is one file (here or anywhere on the Python path) and one yaml under
`conf/model/`: docs/extending.md.
"""

import dataclasses
from typing import Protocol, runtime_checkable

import torch.nn as nn
from omegaconf import OmegaConf
from torch import Tensor

from wapstable.errors import UserError
from wapstable.targets import classes_in, import_class, typed_options

__all__ = ["Watcher", "build_watcher", "builtin_watchers", "legacy_watcher"]


@runtime_checkable
class Watcher(Protocol):
    """What the parser needs of an encoder: `forward(images, mask) -> (features, mask)` maps images `[B, 1, H, W]`
    and their mask (1 on the image, 0 on the padding) to annotations `[B, out_channels, H', W']` and their mask
    `[B, 1, H', W']`, with `H / H' = stride` (the attention pictures place each cell by it). Padding must stay
    invisible: an image alone and the same image padded in a batch give the same annotations on its cells."""

    out_channels: int
    stride: int

    def forward(self, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]: ...


def builtin_watchers() -> dict[str, type]:
    """The watchers of this package by class name, found in its modules (a new file needs no edit here)."""
    return {cls.__name__: cls for cls in classes_in(__name__, __path__, nn.Module) if hasattr(cls, "Options")}


def watcher_options(cls: type, given: dict) -> dict:
    """`given` checked against `cls.Options` (types, unknown keys), as keyword arguments."""
    typed = typed_options(cls.Options, given, "model.watcher", f"the watcher's Options in {cls.__module__}")
    return dataclasses.asdict(typed)


def build_watcher(cfg_watcher) -> nn.Module:
    """The watcher `model.watcher` names by `_target_`, its options checked; a UserError in one sentence otherwise."""
    given = OmegaConf.to_container(OmegaConf.create(dict(cfg_watcher)), resolve=True)
    target = given.pop("_target_", None)
    if not target:
        raise UserError(
            "model.watcher names no class: give it a _target_ (a watcher class, as conf/model/small.yaml does)"
        )
    cls = import_class(target, "model.watcher", "name a watcher on the Python path")
    if not issubclass(cls, nn.Module):
        raise UserError(f"model.watcher._target_={target} is not a watcher: it must be an nn.Module")
    options = (
        watcher_options(cls, given) if dataclasses.is_dataclass(getattr(cls, "Options", None)) else given
    )
    watcher = cls(**options)
    if not (isinstance(watcher, Watcher) and isinstance(watcher.out_channels, int) and watcher.stride >= 1):
        raise UserError(
            f"model.watcher._target_={target} does not declare its out_channels and stride (ints): the parser and "
            "the attention pictures need them (the Watcher protocol in wapstable/model/watchers/__init__.py)"
        )
    return watcher


# The flat keys of every model config from before the watchers were `_target_`s, by the watcher they belonged to.
LEGACY_KEYS = {
    "vgg": ("VGGWatcher", {k: k for k in ("channels", "convs_per_block", "block_convs", "pool_last")}),
    "dense": (
        "DenseWatcher",
        {f"dense_{k}": k for k in ("init_channels", "growth", "layers", "blocks", "compression")}
        | {"dropout": "dropout"},
    ),
}


def legacy_watcher(saved_model: dict) -> dict:
    """A checkpoint's model config from before the watchers were `_target_`s (`watcher: vgg` and the watchers' keys
    flat in `model`): the same model with `watcher: {_target_: ..., its keys}`."""
    if not isinstance(saved_model, dict) or not isinstance(saved_model.get("watcher", "vgg"), str):
        return saved_model
    name, keys = LEGACY_KEYS[saved_model.get("watcher", "vgg")]
    cls = builtin_watchers()[name]
    every_flat_key = {k for _, ks in LEGACY_KEYS.values() for k in ks} - {
        "dropout"
    }  # dropout is the parser's too
    model = {k: v for k, v in saved_model.items() if k not in every_flat_key and k != "watcher"}
    model["watcher"] = {
        "_target_": f"{cls.__module__}.{cls.__qualname__}",
        **{new: saved_model[old] for old, new in keys.items() if old in saved_model},
    }
    return model
