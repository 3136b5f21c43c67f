"""Every option of every config group composes; the schema rejects typos and wrong types, naming the key."""

import sys

import pytest
from conftest import ROOT, compose_config, python_run
from hydra.errors import ConfigCompositionException

from wapstable.stability.clip import build_clip

GROUPS = {
    "model": ["small", "wap", "densewap", "tiny"],
    "data": ["synthetic", "crohme", "wap_pkl", "images"],
    "optim": ["adadelta", "adam", "adam_cosine", "sgd"],
    # every clip rule of conf/clip/, each its own file (tests/test_clip_modes.py: a new one needs no edit here)
    "clip": sorted(p.stem for p in (ROOT / "conf" / "clip").glob("*.yaml")),
    "fault": ["none", "nan_input", "inf_loss", "lr_spike", "attention_overflow", "preempt"],
}


def test_group_files_are_the_listed_options():
    for group, options in GROUPS.items():
        found = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
        assert found == sorted(options), group


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes(group, option):
    cfg = compose_config([f"{group}={option}"])
    node = cfg[group]
    name = option.split("_")[0] if group == "optim" else option  # adam_cosine is Adam with a schedule
    assert (build_clip(node).name if group == "clip" else node.name) == name


def test_defaults():
    cfg = compose_config()
    assert cfg.model.name == "small" and cfg.data.name == "synthetic" and cfg.optim.name == "adam"
    assert cfg.clip._target_.endswith(".NormClip") and cfg.clip.max_norm == 100.0
    assert cfg.model.attention.stable is True and cfg.model.attention.position_features == 32
    assert cfg.guard.skip_nonfinite and cfg.guard.max_consecutive_skips == 5
    # the default run's recipe (docs/studies/recipes.md): data kept at difficulty 2, rendered at 28 pt
    assert cfg.data.difficulty == 2 and cfg.data.font_size == 28 and cfg.data.batch.bucket_by == "tokens"
    assert cfg.optim.lr == 3e-3 and cfg.optim.schedule == "cosine" and cfg.optim.warmup_steps == 150
    assert cfg.trainer.max_minutes == 7.5 and list(cfg.model.watcher.block_convs) == [1, 1, 2, 2]
    # WAP's Adadelta is one option away
    ada = compose_config(["optim=adadelta"]).optim
    assert ada.lr == 1.0 and ada.rho == 0.95 and ada.eps == 1e-6 and ada.weight_decay == 1e-4
    assert ada.schedule == "constant"


@pytest.mark.parametrize("name", ["synthetic_long", "handwritten", "crohme", "wap_crohme", "densewap_crohme"])
def test_experiment_presets(name, tmp_path):
    found = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    assert found == ["crohme", "densewap_crohme", "handwritten", "synthetic_long", "wap_crohme"]
    cfg = compose_config(
        [f"experiment={name}", "data.root=/data"] if "crohme" in name else [f"experiment={name}"]
    )
    if name == "synthetic_long":
        # the default recipe and data distribution, more data and time
        assert cfg.data.name == "synthetic" and cfg.data.difficulty == 2 and cfg.data.num_train == 10000
        assert cfg.trainer.max_minutes == 26 and cfg.model.name == "small"
        assert (cfg.data.num_valid, cfg.data.num_test) == (200, 200)
        return
    if name == "handwritten":
        # rendered handwriting over the CROHME dictionary, drawn as data=crohme draws ink; CROHME only to test
        assert (
            cfg.data.name == "synthetic" and cfg.data.symbols == "crohme" and cfg.data.style == "handwritten"
        )
        assert cfg.data.scale == "symbol" and cfg.data.glyphs == "fonts" and cfg.data.root is None
        assert (cfg.data.jitter, cfg.data.distort) == (1.5, 1.0)  # the glyph variety it was measured with
        # run M1's keys: other forms of most symbols, scripts where writers put them, dropout and label smoothing
        assert (cfg.data.allographs, cfg.data.more_forms, cfg.data.script_place) == (0.8, 0.8, 0.7)
        assert (cfg.model.dropout, cfg.model.label_smoothing) == (0.3, 0.1)
        assert list(cfg.decode.scales) == [1.0, 0.85, 0.7]  # each test image also read shrunk
        assert dict(cfg.data.test_sets) == {"2014": "TestEM2014GT", "2016": "TEST2016_INKML_GT"}
        # twice the drawings of run M1 (runs N2, N3), 2 minutes less training so that the command fits in 60
        assert cfg.data.num_train == 40000 and cfg.trainer.max_minutes == 48
        assert cfg.decode.final_beam_size == 10
        # symbols as often as the CROHME training labels use them (run Q2); readings length-normalised as in WAP
        assert cfg.data.frequencies == "crohme" and cfg.decode.length_power == 1.0
        return
    # every CROHME preset reads the published layout: TrainINKML, a held-out validation split, two test sets
    assert cfg.data.train == "TrainINKML" and cfg.data.valid is None and cfg.data.valid_fraction > 0
    assert dict(cfg.data.test_sets) == {"2014": "TestEM2014GT", "2016": "TEST2016_INKML_GT"}
    if name == "crohme":
        # the CPU recipe: the default model and optimizer, the ink's own scale, pretraining on the rendered data,
        # bounded by the clock so that the whole command fits in 90 minutes on 2 cores
        assert cfg.model.name == "small" and cfg.optim.name == "adam" and cfg.data.scale == "symbol"
        # the clock bounds the pretraining and the training together (pretrain.in_budget), 10 minutes left for the
        # reading, the drawing of the mix and the final beam search
        assert cfg.pretrain.steps == 2500 and cfg.pretrain.in_budget and 0 < cfg.trainer.max_minutes <= 80
        # pretrained on, then mixed with, rendered expressions in real symbols cut from the run's own training files
        pd = cfg.pretrain.data
        assert (pd.style, pd.symbols, pd.glyphs, pd.scale, pd.height) == (
            "handwritten",
            "crohme",
            "crohme",
            "symbol",
            160,
        )
        assert cfg.pretrain.mix == 6000 and cfg.data.warp == 0
        # no curriculum on CROHME after the pretraining, which keeps the rendered data's own (shortest labels first)
        from wapstable.train.build import pretrain_data

        assert cfg.data.batch.curriculum_epochs == 0 and pretrain_data(cfg).batch.curriculum_epochs == 1
        # the test sets read at three scales (chosen on the validation split), the pretraining's quick test at one;
        # the checkpoint records the range its model reads (data.read_range)
        from wapstable.train.stages import plan

        assert list(cfg.decode.scales) == [1.0, 0.85, 1.2]
        cfg.run_dir = str(tmp_path)
        cfg.data.root = str(tmp_path)
        pre = plan(cfg)[0].cfg
        assert list(pre.decode.scales) == [1.0] and pre.decode.final_beam_size == 1
        assert (
            list(cfg.data.read_range.scales) == [0.7, 0.85, 1.2, 1.4] and cfg.data.read_range.tolerance == 3
        )
        return
    # the papers' recipes: Adadelta lr 1.0, batch 8, global-norm clip 100, beam 10, no wall-clock limit
    assert cfg.data.name == "crohme" and cfg.data.batch.max_batch == 8 and cfg.trainer.max_minutes == 0
    assert cfg.optim.name == "adadelta" and cfg.optim.lr == 1.0 and cfg.optim.weight_decay == 1e-4
    assert (
        cfg.clip._target_.endswith(".NormClip")
        and cfg.clip.max_norm == 100.0
        and cfg.decode.final_beam_size == 10
    )
    assert cfg.model.attention.position_features == 0 and not cfg.model.watcher.get("block_convs")
    if name == "wap_crohme":
        assert cfg.model.name == "wap" and list(cfg.model.watcher.channels) == [32, 64, 64, 128]
        assert cfg.model.watcher.convs_per_block == 4 and cfg.model.dropout == 0.5
    else:
        assert cfg.model.name == "densewap" and cfg.model.watcher.growth == 24 and cfg.model.dropout == 0.2
        assert cfg.model.watcher.dropout == 0.2
        assert cfg.model.attention.dim == 512 and cfg.model.attention.coverage_kernel == 11


def test_paper_sizes():
    wap = compose_config(["model=wap"]).model
    assert (
        list(wap.watcher.channels) == [32, 64, 64, 128]
        and wap.watcher.convs_per_block == 4
        and wap.hidden_dim == 256
    )
    dense = compose_config(["model=densewap"]).model
    assert dense.watcher.growth == 24 and dense.watcher.layers == 16 and dense.watcher.compression == 0.5


def test_unknown_key_rejected():
    with pytest.raises(ConfigCompositionException, match="max_nrom"):
        compose_config(["clip.max_nrom=3"])


def test_wrong_type_rejected():
    with pytest.raises(ConfigCompositionException, match="max_steps"):
        compose_config(["trainer.max_steps=ten"])


def test_cli_errors_name_the_problem():
    def run(*args):
        return python_run([sys.executable, "train.py", *args, "--cfg", "job"])

    wrong_option = run("clip=foo")
    assert wrong_option.returncode != 0
    assert "Could not find 'clip/foo'" in wrong_option.stderr and "autoclip" in wrong_option.stderr
    typo = run("trainer.max_stepz=3")
    assert typo.returncode != 0 and "max_stepz" in typo.stderr
    ok = run("optim=adam", "trainer.max_steps=200")
    assert ok.returncode == 0 and "max_steps: 200" in ok.stdout and "name: adam" in ok.stdout


def test_help_shows_config():
    proc = python_run([sys.executable, "train.py", "--help"])
    assert proc.returncode == 0
    assert "clip: agc, autoclip, inf, none, norm, value" in proc.stdout
    assert "max_steps" in proc.stdout


def test_debug_tiny_is_a_short_run_that_wins_over_a_preset_but_not_the_command_line():
    cfg = compose_config(["debug=tiny"])
    assert (
        list(cfg.model.watcher.channels) == [4, 8, 8, 8]
        and cfg.data.num_train == 48
        and cfg.decode.max_len == 12
    )
    assert cfg.trainer.max_steps == 20 and cfg.trainer.max_minutes == 0 and cfg.trainer.threads == 1
    cfg = compose_config(["experiment=synthetic_long", "debug=tiny", "trainer.max_steps=50"])
    assert cfg.data.num_train == 48 and cfg.trainer.max_minutes == 0  # not the preset's 10,000 and 26 min
    assert cfg.trainer.max_steps == 50  # the command line wins


@pytest.mark.parametrize("source", sorted(p.stem for p in (ROOT / "conf" / "data").glob("*.yaml")))
def test_debug_tiny_composes_with_every_source_and_sets_only_the_keys_it_has(source):
    """debug=tiny sets the keys every source shares, and data=synthetic's own sizes only where it is the data
    (conf/debug/data/tiny_synthetic.yaml): a source without them composes with it."""
    cfg = compose_config([f"data={source}", "data.root=somewhere", "debug=tiny"])
    assert cfg.data.batch.max_batch == 8 and cfg.data.render_workers == 1
    assert cfg.data.get("num_train", 48) == 48 and cfg.data.get("difficulty", 1) == 1
    assert cfg.pretrain.data.num_train == 48  # the rendered data of a pretraining, whatever the run's source


def test_each_source_owns_its_keys():
    """A built-in source's own keys are typed on its schema (data/schema.py), and refused, naming the key and the
    schema, where another source is the data."""
    from omegaconf import OmegaConf

    from wapstable.data.schema import CrohmeData, DataConfig, SyntheticData

    synthetic = compose_config(["data.style=handwritten", "data.num_train=7"]).data
    assert OmegaConf.get_type(synthetic) is SyntheticData and synthetic.num_train == 7
    crohme = compose_config(["data=crohme", "data.root=x", "data.redraw=2"]).data
    assert OmegaConf.get_type(crohme) is CrohmeData and crohme.redraw == 2 and "num_train" not in crohme
    images = compose_config(["data=images", "data.root=x"]).data
    assert OmegaConf.get_type(images) is DataConfig and not {"redraw", "style"} & set(images)
    refused = [
        (["data=crohme", "data.root=x", "data.num_train=5"], "num_train", "CrohmeData"),
        (["data.redraw=1"], "redraw", "SyntheticData"),
        (["data=images", "data.root=x", "data.style=handwritten"], "style", "DataConfig"),
        (["data=wap_pkl", "data.root=x", "data.redraw=1"], "redraw", "DataConfig"),
    ]
    for args, key, schema in refused:
        with pytest.raises(ConfigCompositionException) as info:
            compose_config(args)
        assert f"Key '{key}' not in '{schema}'" in str(info.value) + str(info.value.__cause__), args
    for preset in ("handwritten", "synthetic_long"):  # presets of the rendered data: its keys, not CROHME's
        with pytest.raises(ConfigCompositionException) as info:
            compose_config([f"experiment={preset}", "data=crohme", "data.root=x"])
        said = str(info.value) + str(info.value.__cause__)
        assert f"experiment/{preset}" in said and "not in 'CrohmeData'" in said
    proc = python_run(
        [sys.executable, "train.py", "data=crohme", "data.root=x", "data.difficulty=3", "--cfg", "job"]
    )
    assert proc.returncode != 0 and "Key 'difficulty' not in 'CrohmeData'" in proc.stderr
