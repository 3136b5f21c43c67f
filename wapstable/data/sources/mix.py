"""A source that combines two others: the splits of `base`, with the training samples of `extra` added to its
training split. An expression of `extra` whose label is one of `base`'s validation labels is left out, so the
validation split stays unseen. `pretrain.mix` builds one from the run's data and the rendered data
(wapstable/train/build.py: `mixed_source`)."""

import logging
from collections.abc import Sequence

from wapstable.data.sample import Splits
from wapstable.data.sources import source_of
from wapstable.data.sources.base import DataSource

log = logging.getLogger(__name__)


class MixSource(DataSource):
    """`base`'s splits (read with the data config given to `splits`), plus the training split of `extra_cfg`'s
    source, each of its ids prefixed with `prefix`; `what` names the mix in the log line, `kind` its samples."""

    name = "mix"
    combines = True

    def __init__(self, extra_cfg, prefix: str = "mixed-", what: str = "mix", kind: str | None = None):
        super().__init__()
        self.extra_cfg, self.prefix, self.what = extra_cfg, prefix, what
        self.kind = kind or str(extra_cfg.name)  # the log line's word for extra's samples

    def splits(self, cfg_data, which: Sequence[str]):
        base = source_of(cfg_data)
        reads = list(which) if "train" not in which or "valid" in which else [*which, "valid"]
        splits = base.splits(cfg_data, reads)
        splits = splits if isinstance(splits, Splits) else Splits(splits)
        if "train" in which:
            held = {" ".join(s.tokens) for s in splits["valid"]}
            extra = source_of(self.extra_cfg).splits(self.extra_cfg, ["train"])["train"]
            mixed = [s._replace(id=f"{self.prefix}{s.id}") for s in extra if " ".join(s.tokens) not in held]
            log.info(
                "%s: %d %s expressions in the training split (%d left out: a validation label)",
                self.what,
                len(mixed),
                self.kind,
                len(extra) - len(mixed),
            )
            splits["train"] = list(splits["train"]) + mixed
        for split in set(reads) - set(which):
            del splits[split]
        return splits
