"""The evaluator: a split of the run's data (or some of its samples) read by the run's model, through the same code
as scripts/evaluate.py; the validations during training and the final test of the best checkpoint."""

from pathlib import Path

import torch

from wapstable.checkpoint import inference_weights, load_checkpoint
from wapstable.data.normalize import readings_at
from wapstable.device import autocast
from wapstable.eval.evaluation import evaluate_samples, score_test_sets
from wapstable.model.loss import sequence_loss
from wapstable.train.parts import RunParts


class Evaluator:
    """Reads `parts.eval_model` (the model, or its average) on `parts.splits` as `parts.cfg.decode` says."""

    def __init__(self, parts: RunParts):
        self.parts = parts

    @torch.no_grad()
    def evaluate(
        self, split: str, beam_size: int | None = None, samples=None, scales=(1.0,), with_loss: bool = True
    ) -> dict:
        """Metrics (and, `with_loss`, the teacher-forced loss) of a split (or of `samples` of it), read at
        `scales`."""
        p = self.parts
        cfg = p.cfg
        model = p.eval_model
        model.scale_energies(1.0)  # faults act on training steps only

        def loss_fn(model, batch):
            with autocast(p.device, cfg.trainer.precision):
                logits = model(batch.images, batch.image_mask, batch.targets, batch.target_mask)
            return sequence_loss(logits, batch.targets, batch.target_mask)

        return evaluate_samples(
            model,
            p.vocab,
            p.splits[split] if samples is None else samples,
            beam_size or cfg.decode.beam_size,
            cfg.decode.max_len,
            cfg.data.batch.pixel_budget,
            cfg.data.batch.max_batch,
            p.device,
            loss_fn=loss_fn if with_loss else None,
            scales=tuple(scales),
            length_power=float(cfg.decode.length_power),
        )

    def validate(self, step: int) -> dict:
        """The validation split's record at `step`: step, exprate, wer, loss."""
        result = self.evaluate("valid")
        return {"step": step, "exprate": result["exprate"], "wer": result["wer"], "loss": result["loss"]}

    def read_scales(self, best_path: Path, scales) -> dict[float, float]:
        """The validation split's greedy ExpRate at scale 1 and at each of `scales`, read by the checkpoint at
        `best_path` (the model as it is, where there is none): what data.read_range records."""
        self.load_best(best_path)
        # the loss is the same at every scale (teacher-forced on the images as they are) and not recorded
        return readings_at(
            lambda f: self.evaluate("valid", beam_size=1, scales=(f,), with_loss=False)["exprate"], scales
        )

    def load_best(self, best_path: Path) -> None:
        if best_path.is_file():
            self.parts.eval_model.load_state_dict(inference_weights(load_checkpoint(best_path)))

    def test(self, best_path: Path) -> dict[str, dict]:
        """The test sets one by one, read by the checkpoint at `best_path` (the model as it is, where there is
        none) with beam decode.final_beam_size at decode.scales."""
        p = self.parts
        self.load_best(best_path)
        decode = p.cfg.decode
        return score_test_sets(
            lambda samples: self.evaluate(
                "test", beam_size=decode.final_beam_size, samples=samples, scales=decode.scales
            ),
            p.splits["test"],
            p.splits.report["test_sets"],
        )
