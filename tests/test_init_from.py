"""init_from=CKPT: the weights of another run start this one, token rows matched by name."""

import pytest
import torch
from conftest import compose_config

from wapstable.checkpoint import save_checkpoint
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
    src, dst = model_of(src_vocab, counting=0.5), model_of(dst_vocab, counting=0.5)
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
    assert VOCAB_ROWS & set(s) == VOCAB_ROWS  # every per-token parameter is named in VOCAB_ROWS


def test_another_model_is_refused(tmp_path):
    vocab = Vocab(["<eol>", "x"])
    save_checkpoint(
        {"model": model_of(vocab, hidden_dim=24).state_dict(), "vocab": vocab.tokens}, tmp_path / "a.pt"
    )
    with pytest.raises(UserError, match="another size.*same model config"):
        init_from(model_of(vocab), tmp_path / "a.pt", vocab)
    save_checkpoint(
        {"model": model_of(vocab, counting=0.5).state_dict(), "vocab": vocab.tokens}, tmp_path / "b.pt"
    )
    with pytest.raises(UserError, match="another model.*counter"):
        init_from(model_of(vocab), tmp_path / "b.pt", vocab)
    with pytest.raises(UserError, match="does not exist"):
        init_from(model_of(vocab), tmp_path / "none.pt", vocab)
    save_checkpoint({"step": 3}, tmp_path / "c.pt")
    with pytest.raises(UserError, match="no model weights"):
        init_from(model_of(vocab), tmp_path / "c.pt", vocab)
