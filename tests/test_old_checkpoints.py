"""A checkpoint written before the parts were built from `_target_` still resumes and evaluates: its clip section
(`clip.mode` and every mode's keys flat, AutoClip's history under guard.history), its watcher (`model.watcher: vgg`
and the watchers' keys flat in `model`), its data source (`data.name` alone, the batching keys flat in `data`) and
its pretraining's data (no `pretrain.rendered`) map onto today's rules, watchers, sources and sections."""

from conftest import run_train

OLD_CLIP = {
    "mode": "autoclip",
    "max_norm": 100.0,
    "norm_type": 2.0,
    "value": 1.0,
    "factor": 0.01,
    "eps": 0.001,
    "percentile": 20.0,
    "history": 10000,
}
OLD_WATCHER_KEYS = {"dense_init_channels": 48, "dense_growth": 24, "dense_layers": 16, "dense_blocks": 3}


def make_old(state: dict) -> None:
    """`state` (a checkpoint of today) as the release before the `_target_`s wrote it."""
    config = state["config"]
    assert config["clip"]["_target_"].endswith(".AutoClip")
    config["clip"] = OLD_CLIP
    if "clip" in state.get("guard", {}):
        state["guard"]["history"] = state["guard"].pop("clip")["history"]
    model = config["model"]
    watcher = model.pop("watcher")
    assert watcher["_target_"] == "wapstable.model.watchers.vgg.VGGWatcher"
    assert watcher.pop("first_stride") == 1  # a key the watchers gained after the flat keys were gone
    model |= {k: v for k, v in watcher.items() if k != "_target_"}
    model |= {"watcher": "vgg", **OLD_WATCHER_KEYS, "dense_compression": 0.5}
    data = config["data"]
    assert (
        data.pop("_target_") == "wapstable.data.sources.synthetic.SyntheticSource"
        and data.pop("options") == {}
    )
    data |= data.pop("batch")  # the batching keys flat in data, as before data.batch
    data |= {"redraw": 0, "redraw_strength": 1.0}  # every source's keys, as before each source owned its own
    data["max_batch"] = 5  # a value of its own, which must survive the mapping
    for section in ("rendered", "data"):  # and so in the pretraining's data, before pretrain.rendered
        config["pretrain"][section] = {}


def test_a_checkpoint_from_before_the_targets_resumes_and_evaluates(tmp_path, cache_dir):
    from wapstable.checkpoint import load_checkpoint, save_checkpoint
    from wapstable.eval.evaluation import load_model

    run = tmp_path / "run"
    args = ["clip=autoclip", "clip.percentile=20", "trainer.max_steps=2", "trainer.checkpoint_every=2"]
    run_train([*args, "trainer.eval_every=2"], run, cache_dir)
    for name in ("last.pt", "best.pt"):
        path = run / "checkpoints" / name
        state = load_checkpoint(path)
        make_old(state)
        save_checkpoint(state, path)
    assert load_checkpoint(run / "checkpoints" / "last.pt")["guard"]["history"]["count"] == 2

    model, _, cfg = load_model(run / "checkpoints" / "best.pt")  # evaluate.py's and predict.py's reader
    assert type(model.watcher).__name__ == "VGGWatcher" and model.watcher.stride == 16
    assert cfg.data._target_.endswith(".SyntheticSource") and cfg.clip._target_.endswith(".AutoClip")
    assert cfg.data.batch.max_batch == 5 and "max_batch" not in cfg.data and "redraw" not in cfg.data
    assert (
        cfg.pretrain.rendered.name == "synthetic"
    )  # conf/data/synthetic.yaml, as such a config's pretraining read

    run_train(["resume=auto", "trainer.max_steps=4", "trainer.checkpoint_every=4"], run, cache_dir)
    resumed = load_checkpoint(run / "checkpoints" / "last.pt")
    config = resumed["config"]
    assert config["clip"] == {
        "_target_": "wapstable.stability.clip.autoclip.AutoClip",
        "percentile": 20.0,
        "history": 10000,
    }
    assert resumed["guard"]["clip"]["history"]["count"] == 4  # the old history, continued
    assert config["model"]["watcher"] == {
        "_target_": "wapstable.model.watchers.vgg.VGGWatcher",
        "channels": [4, 8, 8, 8],
        "convs_per_block": 1,
        "block_convs": [],
        "pool_last": True,
    }
    assert "dense_growth" not in config["model"] and config["data"]["_target_"].endswith(".SyntheticSource")


def test_an_old_data_name_maps_to_its_source_not_the_default():
    """A checkpoint's data section from before data._target_ holds only data.name: the source that name was, not
    the schema's default (synthetic), or an old CROHME checkpoint would evaluate on rendered data. It holds every
    source's keys too (from before each source owned its own): each source keeps its own and the shared ones."""
    import dataclasses

    from omegaconf import OmegaConf

    from wapstable.config import Config, checkpoint_config
    from wapstable.data.schema import CrohmeData, SyntheticData, data_schema
    from wapstable.data.sources import builtin_sources

    every_key = OmegaConf.to_container(OmegaConf.structured(SyntheticData)) | OmegaConf.to_container(
        OmegaConf.structured(CrohmeData)
    )
    for name, cls in builtin_sources().items():
        saved = OmegaConf.to_container(OmegaConf.structured(Config))
        saved["data"] = {k: v for k, v in every_key.items() if k not in ("_target_", "options")} | {
            "name": name
        }
        saved["data"]["render_workers"] = 1  # a shared key's own value, which must survive
        merged = checkpoint_config(saved, [], OmegaConf.structured(Config))
        target = f"{cls.__module__}.{cls.__qualname__}"
        assert merged.data._target_ == target, name
        schema = data_schema(target)
        assert set(merged.data) == {f.name for f in dataclasses.fields(schema)}, name
        assert OmegaConf.get_type(merged.data) is schema and merged.data.render_workers == 1, name


def test_an_old_dense_model_maps_to_the_densenet_watcher():
    from omegaconf import OmegaConf

    from wapstable.config import Config, checkpoint_config

    saved = OmegaConf.to_container(OmegaConf.structured(Config))
    model = {k: v for k, v in saved["model"].items() if k != "watcher"}
    saved["model"] = model | {"watcher": "dense", "channels": [16, 32], "convs_per_block": 2, "dropout": 0.2}
    saved["model"] |= {**OLD_WATCHER_KEYS, "dense_growth": 12, "dense_compression": 0.5}
    merged = checkpoint_config(saved, [], OmegaConf.structured(Config)).model
    assert OmegaConf.to_container(merged.watcher) == {
        "_target_": "wapstable.model.watchers.dense.DenseWatcher",
        "init_channels": 48,
        "growth": 12,
        "layers": 16,
        "blocks": 3,
        "compression": 0.5,
        "dropout": 0.2,
    }
    assert merged.dropout == 0.2  # the parser's too
