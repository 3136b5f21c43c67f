"""The documentation kept true: every relative link of README.md and docs/ resolves (anchors included), every
console command is in the README's table, every config key the README names exists, the README's Python snippet
runs, and every command in its fenced blocks is either run here with tiny overrides (test-all) or listed as
long-running on purpose."""

import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT, compose_config, python_run
from omegaconf import OmegaConf

README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without its fenced blocks and inline code (links there are examples, not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"^#{1,6} (.+)$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    bad = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{name}: {target} (no such heading)")
    return bad


def test_every_relative_link_resolves():
    assert len(PAGES) > 10
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# A heading: `with=code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-heading-withcode) ![missing](gone.png) [bad](there.md#nowhere)\n"
        "`[not a link](gone.md)`\n```\n[not a link](gone.md)\n```\n"
    )
    bad = broken_links(page)
    assert len(bad) == 2 and "gone.png" in bad[0] and "#nowhere" in bad[1]


def test_readme_is_short_and_its_console_table_is_complete():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    rows = {m.group(1) for m in re.finditer(r"^\| `(wapstable-[\w-]+)", text, re.M)}
    assert rows == set(scripts), (
        f"missing from the README's table: {set(scripts) - rows}; extra: {rows - set(scripts)}"
    )


# --- config keys -----------------------------------------------------------------------------------------------
GROUPS = "trainer|data|model|optim|clip|guard|stats|decode|pretrain|fault|logger"
KEY = re.compile(rf"(?<![\w+~./-])((?:{GROUPS})\.[a-z_][\w]*(?:\.[a-z_][\w]*)*)")
NOT_KEYS = {"data.zip"}  # CoMER's archive, named in prose


def named_keys(text: str) -> set[str]:
    """The config keys named in prose and commands (Python snippets name attributes, not keys)."""
    text = FENCE.sub(lambda m: "" if m.group(1) == "python" else m.group(2), text)
    return {k for k in KEY.findall(text) if k not in NOT_KEYS}


def missing_keys(text: str) -> list[str]:
    # the default config, and each option of the groups whose options have keys of their own
    clips = sorted(p.stem for p in (ROOT / "conf" / "clip").glob("*.yaml"))
    configs = [
        compose_config([]),
        compose_config(["data=images"]),
        *(compose_config([f"clip={c}"]) for c in clips),
    ]
    absent = object()
    return sorted(
        k for k in named_keys(text) if all(OmegaConf.select(c, k, default=absent) is absent for c in configs)
    )


def test_every_config_key_the_readme_names_exists():
    text = README.read_text()
    keys = named_keys(text)
    assert {"clip.max_norm", "trainer.max_minutes", "guard.max_consecutive_skips"} <= keys
    assert missing_keys(text) == []
    assert missing_keys("set `clip.max_norms=3` or trainer.max_stepz=4") == [
        "clip.max_norms",
        "trainer.max_stepz",
    ]


# --- the Python snippet ----------------------------------------------------------------------------------------
def test_the_readme_guard_snippet_runs_and_skips_a_nan_batch(tmp_path, monkeypatch):
    import torch

    snippet = next(body for lang, body in FENCE.findall(README.read_text()) if lang == "python")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    bad = x.clone()
    bad[0, 0] = float("nan")
    loader = [(x, torch.zeros(4, 1)), (bad, torch.zeros(4, 1)), (x, torch.zeros(4, 1))]
    printed = []
    space = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10),
        "loader": loader,
        "loss_fn": torch.nn.functional.mse_loss,
        "print": lambda *a: printed.append(a),
    }
    exec(compile(snippet, "README.md", "exec"), space)
    assert len(printed) == 1 and printed[0][1]  # the NaN batch skipped, with its reason
    assert Path(printed[0][2]).is_file()  # its anomaly checkpoint


# --- commands --------------------------------------------------------------------------------------------------
def readme_commands(text: str) -> list[str]:
    """Each command of the README's fenced blocks: the lines of bash blocks, and the `$ ` lines of transcripts."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang in ("bash", "sh"):
            for line in body.replace("\\\n", " ").splitlines():
                line = re.split(r"\s{2,}#|^#", line)[0].strip()
                if line:
                    out.append(" ".join(line.split()))
        elif lang == "":
            out += [line[2:].strip() for line in body.splitlines() if line.startswith("$ ")]
    return out


# Commands that take minutes to hours, need a licensed data set, or change the environment: not run here, each
# with the reason.
LONG = {
    "make train": "the default run: 10 minutes (its code runs here as `python train.py` with tiny overrides)",
    "make test": "the test suite itself",
    "make install": "creates .venv: what make test already did",
    "source .venv/bin/activate": "changes the calling shell",
    "pip install .": "installs: tests/test_install.py installs the checkout and runs every command (test-all)",
    'pip install ".[sweep]"': "installs the extra, which make test's .venv holds",
    "python train.py experiment=crohme data.root=DIR clip=norm clip.max_norm=600": "the CROHME recipe, 85 min",
    "python train.py experiment=crohme data.root=DIR": "the CROHME recipe, 85 min on licensed data",
    "python train.py -m hydra/launcher=slurm hydra.launcher.partition=NAME resume=auto clip=norm,inf": "a cluster",
    "torchrun --nproc_per_node=4 train.py trainer.ddp=true hydra.run.dir=outputs/wap-4gpu": "4 GPUs; "
    "tests/test_ddp.py runs torchrun with two CPU processes",
    "make lint": "CI runs it",
    "make figures": "minutes; tests/test_figures.py draws each picture",
    "make smoke PYTHON=python3.13": "a fresh environment of another Python; CI runs it",
    "python train.py -m hparams_search=optuna hydra.sweeper.n_trials=50": "50 trials; run here with 2",
}
# The rest run, in the README's order, in one folder, with tiny overrides placed after the README's own: command
# -> (overrides appended, exit status). DIR, IMGDIR, HMEDIR, WAPDIR and RUN are folders this test writes.
TINY = ["debug=tiny", "trainer.progress=false", "trainer.threads=1", "logger=[]"]
RUNS = {
    "python train.py": ([], 0),
    "python train.py debug=tiny": ([], 0),
    "python train.py clip=agc clip.factor=0.02 optim=adam optim.lr=1e-3 trainer.max_steps=2000 trainer.max_minutes=0": (
        ["trainer.max_steps=4"],
        0,
    ),
    "python train.py model=densewap 'logger=[tensorboard,csv]' hydra.run.dir=outputs/dense": (
        [
            "trainer.max_steps=2",
            "model.watcher.layers=2",
            "model.watcher.blocks=2",
            "model.watcher.init_channels=8",
        ],
        0,
    ),
    "python train.py --cfg job": ([], 0),
    "python train.py model.attention.stable=false fault=attention_overflow fault.step=20 trainer.max_steps=60 "
    "hydra.run.dir=outputs/overflow-naive": ([], 3),
    "python scripts/replay_anomaly.py outputs/overflow-naive/anomalies/step-20.pt": ([], 1),
    "python scripts/replay_anomaly.py outputs/overflow-naive/anomalies/step-20.pt --set model.attention.stable=true": (
        [],
        0,
    ),
    "python train.py resume=outputs/overflow-naive/anomalies/step-20.pt model.attention.stable=true "
    "hydra.run.dir=outputs/overflow-fixed": ([], 0),
    "python scripts/grad_report.py RUN": ([], 0),
    "python scripts/evaluate.py RUN/checkpoints/best.pt": ([], 0),
    "python scripts/evaluate.py RUN/checkpoints/best.pt data=crohme data.root=DIR split=test --out results.json": (
        [],
        0,
    ),
    "python scripts/evaluate.py RUN/checkpoints/best.pt split=valid --predictions valid.jsonl": ([], 0),
    "python scripts/predict.py RUN/checkpoints/best.pt formula.png scan.jpg --attention att.png": ([], 0),
    "python train.py data=images data.root=IMGDIR data.symbols=crohme +data.test_sets.2014=2014": (
        ["data.valid_fraction=0.3", "trainer.max_steps=2"],
        0,
    ),
    "python train.py data=images data.root=HMEDIR": (["data.valid_fraction=0.3", "trainer.max_steps=2"], 0),
    "python train.py data=wap_pkl data.root=WAPDIR": (["trainer.max_steps=2"], 0),
    "python train.py -m clip=none,norm,agc optim.lr=1e-3,3e-3": (["trainer.max_steps=2"], 0),
    "python scripts/summarize_sweep.py multirun/DATE/TIME": ([], 0),
}


def test_every_readme_command_is_run_or_listed_as_long():
    commands = readme_commands(README.read_text())
    assert "make train" in commands and "python scripts/grad_report.py RUN" in commands
    unlisted = [c for c in commands if c not in RUNS and c not in LONG]
    assert not unlisted, f"README commands neither run by tests/test_docs.py nor listed as long: {unlisted}"
    gone = [c for c in [*RUNS, *LONG] if c not in commands]
    assert not gone, f"listed in tests/test_docs.py but no longer in the README: {gone}"
    assert not set(RUNS) & set(LONG)


def write_folders(tmp: Path) -> None:
    """The data the README's commands name, small: a CROHME folder, CoMER's and HME100K's layouts, WAP pickles,
    and two images to recognise."""
    from test_crohme import published_layout
    from test_images import LABELS, comer_folder, hme_folder, picture

    from wapstable.data.sample import Sample
    from wapstable.data.sources.wap_pkl import write_wap_split

    published_layout(tmp / "DIR")
    comer_folder(tmp / "IMGDIR")
    hme_folder(tmp / "HMEDIR")
    import numpy as np

    wap = tmp / "WAPDIR"
    wap.mkdir()
    tokens = sorted({t for label in LABELS for t in label.split()})
    (wap / "dictionary.txt").write_text(
        "<eol>\t0\n" + "".join(f"{t}\t{i + 1}\n" for i, t in enumerate(tokens))
    )
    for split, n in (("train", 3), ("valid", 1), ("test", 1)):
        samples = [
            Sample(f"{split}{k}", np.asarray(picture(label, 24, dark_on_light=False)), label.split())
            for k, label in enumerate(LABELS * n)
        ]
        write_wap_split(samples, wap / f"offline-{split}.pkl", wap / f"{split}_caption.txt")
    picture("1 + 2", 28, dark_on_light=True).save(tmp / "scan.jpg")
    picture("3 - 4", 28, dark_on_light=False).save(tmp / "formula.png")


def argv(command: str, tmp: Path, extra: list[str]) -> list[str]:
    places = {name: tmp / name for name in ("RUN", "DIR", "IMGDIR", "HMEDIR", "WAPDIR")}
    places["multirun/DATE/TIME"] = tmp / "multirun" / "sweep"
    pattern = re.compile(r"(?<![\w/])(multirun/DATE/TIME|RUN|DIR|IMGDIR|HMEDIR|WAPDIR)(?!\w)")
    words = [pattern.sub(lambda m: str(places[m.group(1)]), w) for w in shlex.split(command)]
    assert words[0] == "python"
    script = ROOT / words[1]
    args = words[2:]
    if words[1] == "train.py":
        if "--cfg" in args:
            return [sys.executable, str(script), *args]
        sweep = "-m" in args
        if not sweep and not any(a.startswith("hydra.run.dir=") for a in args):
            args.append(f"hydra.run.dir={tmp / 'runs' / str(len(list((tmp / 'runs').glob('*'))))}")
        if sweep:
            args.append(f"hydra.sweep.dir={tmp / 'multirun' / 'sweep'}")
        resumed = any(a.startswith("resume=") for a in args)
        flags = ["-m"] if sweep else []
        args = [a for a in args if a != "-m"]
        return [sys.executable, str(script), *flags, *([] if resumed else TINY), *args, *extra]
    return [sys.executable, str(script), *args, *extra]


@pytest.mark.slow
def test_the_readme_commands_run(tmp_path, cache_dir):
    """Each command the README shows, in its order, with tiny overrides: it exits as the README says."""
    import os

    write_folders(tmp_path)
    (tmp_path / "runs").mkdir()
    env = {**os.environ, "WAPSTABLE_CACHE": str(cache_dir), "HYDRA_FULL_ERROR": "1"}
    # RUN: a finished tiny run with a checkpoint and gradient statistics, as the README's RUN is
    proc = python_run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            *TINY,
            "stats.every=1",
            "data.symbols=crohme",
            f"hydra.run.dir={tmp_path / 'RUN'}",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for command in readme_commands(README.read_text()):
        if command not in RUNS:
            continue
        extra, status = RUNS[command]
        proc = python_run(argv(command, tmp_path, extra), cwd=tmp_path, env=env, timeout=900)
        assert proc.returncode == status, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert (tmp_path / "outputs" / "overflow-naive" / "anomalies" / "step-20.pt").is_file()
    assert (tmp_path / "results.json").is_file() and (tmp_path / "valid.jsonl").is_file()
    assert (tmp_path / "multirun" / "sweep" / "summary.csv").is_file()
    assert (tmp_path / "RUN" / "grad_report.md").is_file()


def test_a_command_outside_both_lists_is_caught():
    text = "```bash\npython train.py clip=norm  # a comment\nmake train\n```\n```\n$ python x.py\nout\n```\n"
    assert readme_commands(text) == ["python train.py clip=norm", "make train", "python x.py"]
    assert [c for c in readme_commands(text) if c not in RUNS and c not in LONG] == [
        "python train.py clip=norm",
        "python x.py",
    ]


def test_the_make_targets_the_readme_names_exist():
    """The make targets the README names exist in the Makefile."""
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {c.split()[1] for c in readme_commands(README.read_text()) if c.startswith("make ")}
    assert named <= targets, named - targets
