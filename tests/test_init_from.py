"""init_from=CKPT: the weights of another run start this one, token rows matched by name."""

import pytest
import torch
from conftest import compose_config

from wapstable.checkpoint import load_checkpoint, save_checkpoint
from wapstable.data.vocab import Vocab
from wapstable.errors import UserError
from wapstable.model.wap import build_model
from wapstable.train.build import VOCAB_ROWS, init_from


def model_of(vocab, **model_over):
    cfg = compose_config(["debug=tiny", *(f"model.{k}={v}" for k, v in model_over.items())]).model
    torch.manual_seed(len(vocab))
    return build_model(cfg, len(vocab))


def test_weights_copied_and_token_rows_matched_by_name(tmp_path):
    src_vocab = Vocab(["<eol>", "x", "+", "1"])
    dst_vocab = Vocab(["<eol>", "1", "\\sin", "x", "y"])  # 1 and x shared at other rows; \sin and y new
    src, dst = (
        model_of(src_vocab, counting=0.5, symbol_map=1),
        model_of(dst_vocab, counting=0.5, symbol_map=1),
    )
    # every per-token parameter (its size follows the vocabulary's: 4 tokens here, 5 there) is named in VOCAB_ROWS,
    # and VOCAB_ROWS names nothing else: a per-token tensor it missed would be refused as "another size"
    s, d = src.state_dict(), dst.state_dict()
    assert {k for k in s if s[k].shape != d[k].shape} == VOCAB_ROWS
    fresh = {k: v.clone() for k, v in dst.state_dict().items()}
    save_checkpoint({"model": src.state_dict(), "vocab": src_vocab.tokens}, tmp_path / "src.pt")

    loaded = init_from(dst, tmp_path / "src.pt", dst_vocab)
    assert loaded["tokens_shared"] == 3 and loaded["tokens_new"] == 2
    s, d = src.state_dict(), dst.state_dict()
    for key in s:
        if key in VOCAB_ROWS:
            for token in ("<eol>", "1", "x"):
                assert torch.equal(d[key][dst_vocab.index[token]], s[key][src_vocab.index[token]]), (
                    key,
                    token,
                )
            for token in ("\\sin", "y"):
                assert torch.equal(d[key][dst_vocab.index[token]], fresh[key][dst_vocab.index[token]]), (
                    key,
                    token,
                )
        else:
            assert torch.equal(d[key], s[key]), key
    assert torch.equal(d["parser.embed.weight"][-1], s["parser.embed.weight"][-1])  # the start token


def test_another_model_is_refused(tmp_path):
    vocab = Vocab(["<eol>", "x"])
    save_checkpoint(
        {"model": model_of(vocab, hidden_dim=24).state_dict(), "vocab": vocab.tokens}, tmp_path / "a.pt"
    )
    with pytest.raises(UserError, match="another size.*same model config"):
        init_from(model_of(vocab), tmp_path / "a.pt", vocab)
    renamed = {k.replace("gru1", "gru0"): v for k, v in model_of(vocab).state_dict().items()}
    save_checkpoint({"model": renamed, "vocab": vocab.tokens}, tmp_path / "b.pt")
    with pytest.raises(UserError, match="another model.*gru"):
        init_from(model_of(vocab), tmp_path / "b.pt", vocab)
    with pytest.raises(UserError, match="does not exist"):
        init_from(model_of(vocab), tmp_path / "none.pt", vocab)
    save_checkpoint({"step": 3}, tmp_path / "c.pt")
    with pytest.raises(UserError, match="no model weights"):
        init_from(model_of(vocab), tmp_path / "c.pt", vocab)


def test_pretraining_then_crohme_in_one_command(tmp_path, cache_dir):
    """pretrain.steps: the same model first trains on the rendered data in RUN/pretrain, then the run starts from
    its best checkpoint; run again (resume=auto) the finished pretraining is not repeated. With pretrain.in_budget
    (experiment=crohme's), the run's checkpoints keep trainer.max_minutes less the pretraining's minutes, resumed
    too, so a resumed run does not get those minutes again."""
    import json

    from conftest import refusal_in_process, run_train
    from test_crohme import published_layout

    root = published_layout(tmp_path / "CROHME_labeled_2016")
    run = tmp_path / "run"
    args = ["data=crohme", f"data.root={root}", "data.height=32", "pretrain.steps=4", "pretrain.eval_every=2"]
    budget = [*args, "pretrain.in_budget=true", "trainer.max_minutes=5"]
    run_train(budget, run, cache_dir)
    pre = json.loads((run / "pretrain" / "metrics.json").read_text())
    assert pre["steps"] == 4 and [e["step"] for e in pre["evals"]] == [2, 4]
    log = (run / "train.log").read_text()
    assert "data: synthetic, 48 train / 8 valid / 8 test samples" in log  # debug=tiny's pretrain.data
    assert f"init_from {run / 'pretrain' / 'checkpoints' / 'best.pt'}" in log
    assert "pretrain.in_budget: the pretraining took" in log
    assert json.loads((run / "metrics.json").read_text())["steps"] == 3
    saved = load_checkpoint(run / "checkpoints" / "last.pt")["config"]["trainer"]["max_minutes"]
    assert saved == pytest.approx(5 - pre["wall_time_s"] / 60, abs=1e-3) and saved < 5
    before = (run / "pretrain" / "metrics.json").stat().st_mtime_ns
    run_train([*budget, "resume=auto", "trainer.max_steps=6"], run, cache_dir)
    assert (run / "pretrain" / "metrics.json").stat().st_mtime_ns == before
    assert json.loads((run / "metrics.json").read_text())["steps"] == 6
    assert load_checkpoint(run / "checkpoints" / "last.pt")["config"]["trainer"]["max_minutes"] == saved

    assert "pretrain.eval_every=9" in refusal_in_process(
        [*args, "pretrain.eval_every=9"], tmp_path / "bad", cache_dir
    )


@pytest.mark.slow  # make test-all; make test's test_pretraining_then_crohme_in_one_command has the reduced budget
def test_pretrain_in_budget_only_when_asked_and_its_refusals(tmp_path, cache_dir):
    """Without pretrain.in_budget the run keeps the whole trainer.max_minutes; with it, a budget the pretraining uses
    up, or a pretraining whose time cannot be read, is one sentence and exit 2."""
    from conftest import run_train
    from test_crohme import published_layout

    root = published_layout(tmp_path / "CROHME_labeled_2016")
    args = ["data=crohme", f"data.root={root}", "data.height=32", "pretrain.steps=4", "pretrain.eval_every=2"]
    budget = [*args, "pretrain.in_budget=true", "trainer.max_minutes=5"]
    plain = tmp_path / "plain"  # without it the run keeps the whole budget
    run_train([*args, "trainer.max_minutes=5"], plain, cache_dir)
    assert load_checkpoint(plain / "checkpoints" / "last.pt")["config"]["trainer"]["max_minutes"] == 5

    short = run_train(
        [*args, "pretrain.in_budget=true", "trainer.max_minutes=0.0001"],
        tmp_path / "short",
        cache_dir,
        check=False,
    )
    assert (
        short.returncode == 2
        and "leaving no time to train; raise trainer.max_minutes" in short.stdout + short.stderr
    )
    assert not (tmp_path / "short" / "checkpoints" / "last.pt").exists()

    (plain / "pretrain" / "metrics.json").write_text("{")  # a pretraining whose time cannot be read
    broken = run_train([*budget, "trainer.max_steps=6"], tmp_path / "plain", cache_dir, check=False)
    assert (
        broken.returncode == 2
        and "pretrain.in_budget needs the pretraining's time" in broken.stdout + broken.stderr
    )


def test_training_only_heads_may_differ(tmp_path):
    vocab = Vocab(["<eol>", "x", "1"])
    with_heads = model_of(vocab, counting=0.5, symbol_map=1)
    save_checkpoint({"model": with_heads.state_dict(), "vocab": vocab.tokens}, tmp_path / "heads.pt")
    plain = model_of(vocab)
    loaded = init_from(plain, tmp_path / "heads.pt", vocab)  # the heads are left behind
    assert loaded["heads_dropped"] == ["counter", "symbol_head"] and loaded["heads_fresh"] == []
    assert all(torch.equal(v, with_heads.state_dict()[k]) for k, v in plain.state_dict().items())

    save_checkpoint({"model": plain.state_dict(), "vocab": vocab.tokens}, tmp_path / "plain.pt")
    target = model_of(vocab, symbol_map=1)
    before = target.symbol_head.weight.clone()
    loaded = init_from(target, tmp_path / "plain.pt", vocab)  # the head keeps its fresh initialisation
    assert loaded["heads_fresh"] == ["symbol_head"] and loaded["heads_dropped"] == []
    assert torch.equal(target.symbol_head.weight, before)
    assert torch.equal(target.parser.out.weight, plain.parser.out.weight)
    assert loaded["tensors"] == len(plain.state_dict())
