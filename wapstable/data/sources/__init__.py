"""The data sources, one module each, that `data._target_` names: `synthetic` (rendered by the project), `crohme`
(InkML), `wap_pkl` (WAP's pickles) and `images` (a folder of images with a captions file). Each is a `DataSource`
(base.py) whose `splits(cfg_data, which)` gives the samples of the splits named in `which`.

A source is imported when it is used, so a run on CROHME never loads mathtext. A new one is a module (here, or
anywhere on the Python path) and a yaml under conf/data/ naming it: docs/extending.md.
"""

import dataclasses
from collections.abc import Sequence

from omegaconf import OmegaConf

from wapstable.data.sources.base import DataSource
from wapstable.errors import UserError
from wapstable.targets import classes_in, import_class, typed_options

__all__ = ["DataSource", "builtin_sources", "legacy_data", "source_of", "source_splits"]

# data.name -> its class, for the configs of checkpoints from before data._target_ (imported only then)
BUILTIN = {
    "synthetic": "wapstable.data.sources.synthetic.SyntheticSource",
    "crohme": "wapstable.data.sources.crohme.CrohmeSource",
    "wap_pkl": "wapstable.data.sources.wap_pkl.WapPklSource",
    "images": "wapstable.data.sources.images.ImageSource",
}


def builtin_sources() -> dict[str, type]:
    """The sources of this package that a `data._target_` names, by name, found in its modules (imports every source:
    for listings and tests); a source that combines others (mix.py: built by the trainer, not from a yaml) is not
    one of them."""
    return {cls.name: cls for cls in classes_in(__name__, __path__, DataSource) if not cls.combines}


def source_of(cfg_data) -> DataSource:
    """The source `data._target_` names, with its own options (`data.options`) checked; one sentence otherwise."""
    target = cfg_data.get("_target_") if hasattr(cfg_data, "get") else getattr(cfg_data, "_target_", None)
    if not target:
        raise UserError(
            "data names no source: give it a _target_ (a data source class, as conf/data/crohme.yaml does)"
        )
    cls = import_class(target, "data", "name a data source on the Python path")
    if not (isinstance(cls, type) and callable(getattr(cls, "splits", None))):
        raise UserError(
            f"data._target_={target} is not a data source: it must be a class with a splits(cfg_data, which) method "
            "(subclass wapstable.data.sources.base.DataSource)"
        )
    given = getattr(cfg_data, "options", None) or {}
    given = OmegaConf.to_container(OmegaConf.create(dict(given)), resolve=True)
    schema = getattr(cls, "Options", None)
    if not dataclasses.is_dataclass(schema):
        return cls(given) if given else cls()
    return cls(typed_options(schema, given, "data.options", f"{cls.__module__}'s Options"))


def source_splits(cfg_data, which: Sequence[str]):
    """The splits `which` of the source `data._target_` names."""
    return source_of(cfg_data).splits(cfg_data, which)


def legacy_data(saved: dict) -> dict:
    """A checkpoint's data config from before the sources were `_target_`s: the class its data.name named then."""
    if not isinstance(saved, dict) or "_target_" in saved:
        return saved
    return {**saved, "_target_": BUILTIN.get(str(saved.get("name", "synthetic")), BUILTIN["synthetic"])}
