"""The WAP model: the watcher and parser (`wap`), coverage attention (`attention`), the training loss of a batch
(`loss`) and greedy and beam decoding (`decoding`)."""
