"""The protocol of a data source: a class named by `data._target_` (conf/data/NAME.yaml), one module each."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


class DataSource:
    """A data source: `splits(cfg_data, which)` returns the samples of each split named in `which` (`train`,
    `valid`, `test`) as a dict (or a `Splits`, which also carries a report of what was skipped); a `Sample`
    (wapstable/data/sample.py) holds an image (uint8 `[H, W]`, ink bright on black), its tokens, an id and optionally
    its symbol boxes. A missing folder or a bad file is a `wapstable.errors.UserError` in one sentence (or honours
    `cfg_data.on_error`).

    - `name`: the source's name (`data.name` in its yaml);
    - `boxes`: whether its samples carry symbol boxes (what the attention guide and the symbol map train on);
    - `crohme_symbols`: whether its labels are always in the CROHME 2014 dictionary (the vocabulary is then that
      dictionary, not the tokens of the training labels);
    - `Options`: a dataclass of the source's own keys, given under `data.options` and typed and checked before
      anything runs (`self.options`); the keys every source shares (data.root, data.train, the batching keys...)
      are the data config's own (wapstable/data/schema.py, where the built-in sources keep their own keys too: a
      schema read as the config is composed, apart from the heavy modules here).
    """

    name: ClassVar[str] = "source"
    boxes: ClassVar[bool] = False
    crohme_symbols: ClassVar[bool] = False
    combines: ClassVar[bool] = False  # a source made of other sources, built in code (mix.py), not by a yaml

    @dataclass
    class Options:
        pass

    def __init__(self, options=None):
        self.options = options if options is not None else self.Options()

    def splits(self, cfg_data, which: Sequence[str]):
        raise NotImplementedError
