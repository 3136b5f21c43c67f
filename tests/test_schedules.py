"""Learning-rate schedules: one module each in wapstable/train/schedules/, named by `optim.schedule` (a built-in
name, or a node with a `_target_` of the user's own); each checks its options before anything runs."""

import pytest
from conftest import compose_config, refusal_in_process, run_train
from test_loggers import read_csv

from wapstable.errors import UserError
from wapstable.train.optim import lr_factor
from wapstable.train.schedules import build_schedule, builtin_schedules

# A schedule kept outside the package: the lr halves at `at`, with an option of its own, checked.
HALVING = """
from dataclasses import dataclass

from wapstable.errors import UserError


@dataclass
class Halving:
    at: int = 2
    name = "halving"

    def __post_init__(self):
        if self.at < 0:
            raise UserError(f"optim.schedule.at={self.at} must be >= 0")

    def factor(self, step, max_steps, time_done):
        return 0.5 if step >= self.at else 1.0
"""


def test_the_built_in_schedules_are_the_modules_of_the_package():
    names = set(builtin_schedules())
    assert names == {"constant", "cosine", "step"}  # each module's class found by itself, no table
    for name in names:  # each one builds from the composed default optim keys and gives 1.0 at its start
        cfg = compose_config([f"optim.schedule={name}", "optim.warmup_steps=0"])
        assert build_schedule(cfg.optim).factor(0, 100, 0.0) == 1.0


def test_the_step_and_cosine_factors():
    cfg = compose_config(
        ["optim.schedule=step", "optim.step_size=3", "optim.gamma=0.1", "optim.warmup_steps=0"]
    )
    assert [round(lr_factor(cfg.optim, s, 100), 6) for s in (0, 2, 3, 6)] == [1.0, 1.0, 0.1, 0.01]
    cfg = compose_config(["optim.schedule=cosine", "optim.min_lr_ratio=0.2", "optim.warmup_steps=0"])
    assert abs(lr_factor(cfg.optim, 100, 100) - 0.2) < 1e-9  # ends at its floor


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["optim.schedule=linear"],
            "optim.schedule=linear is not a schedule; use one of constant, cosine, step",
        ),
        (["optim.schedule=step", "optim.gamma=2"], "optim.gamma=2.0 must be in (0, 1]"),
        (
            ["optim.schedule=step", "optim.step_size=0"],
            "optim.step_size=0 must be a positive number of steps",
        ),
        (["optim.schedule=cosine", "optim.min_lr_ratio=1.5"], "optim.min_lr_ratio=1.5 must be in [0, 1]"),
        (
            ["optim.schedule={_target_: nowhere.Thing}"],
            "optim.schedule._target_=nowhere.Thing is not an importable",
        ),
    ],
)
def test_a_wrong_schedule_is_one_sentence_before_anything_is_written(tmp_path, cache_dir, args, said):
    assert refusal_in_process(args, tmp_path / "run", cache_dir).startswith(said)


@pytest.mark.slow  # make test-all, as the other parts outside the package; make test runs optim.schedule=step
def test_a_schedule_outside_the_package_trains_through_train_py(tmp_path, cache_dir):
    """A class of the user's, named by its _target_ with its own option: the lr that metrics.csv logs follows it;
    its option's check refuses a bad value with its own sentence (exit 2)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "halving.py").write_text(HALVING)
    env = {"PYTHONPATH": str(mine)}
    node = "optim.schedule={_target_: halving.Halving, at: 3}"
    run = tmp_path / "run"
    run_train(
        [node, "optim.warmup_steps=0", "trainer.max_steps=5", "logger=csv"], run, cache_dir, env_extra=env
    )
    assert read_csv(run / "metrics.csv")["train/lr"] == {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.5, 5: 0.5}
    bad = run_train(
        ["optim.schedule={_target_: halving.Halving, at: -1}"],
        tmp_path / "bad",
        cache_dir,
        False,
        env_extra=env,
    )
    assert bad.returncode == 2 and "optim.schedule.at=-1 must be >= 0" in bad.stdout + bad.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_node_without_target_is_refused():
    cfg = compose_config(["optim.schedule={power: 2}"])
    with pytest.raises(UserError, match="optim.schedule is a node without a _target_"):
        build_schedule(cfg.optim)
