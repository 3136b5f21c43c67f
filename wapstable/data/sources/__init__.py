"""The data sources, one module each, that data.name picks: `synthetic` (rendered by the project), `crohme` (InkML),
`wap_pkl` (WAP's pickles) and `images` (a folder of images with a captions file). Each gives the samples of the
splits named in `which` through one function `(cfg_data, which)`, a dict or a Splits with its report.

A source is imported when it is used, so a run on CROHME never loads mathtext: adding one is a module here and its
entry in SOURCES (and a member of the schema's DataSource Enum, which lists the same names).
"""

import importlib
from collections.abc import Sequence

# data.name -> "module:function" of its splits
SOURCES = {
    "synthetic": "wapstable.data.sources.synthetic:synthetic_splits",
    "crohme": "wapstable.data.sources.crohme:crohme_splits",
    "wap_pkl": "wapstable.data.sources.wap_pkl:wap_pkl_splits",
    "images": "wapstable.data.sources.images:image_splits",
}


def source_splits(cfg_data, which: Sequence[str]):
    """The splits `which` of the source data.name, read by its function in SOURCES."""
    module, function = SOURCES[str(cfg_data.name)].split(":")
    return getattr(importlib.import_module(module), function)(cfg_data, which)
