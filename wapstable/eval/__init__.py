"""Evaluation: ExpRate and WER (`metrics`), decoding a split or an image and drawing its attention
(`evaluation`)."""
