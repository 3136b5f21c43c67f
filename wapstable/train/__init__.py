"""The training run, by concern.

- `build`: config -> components, and every check that runs before a file is written
- `state`: the training state, saved by checkpoints and snapshots and loaded by resume, rollback and the benchmark
- `step`: one guarded step (forward with the fault, `StepGuard.step`), a skip's rollback or stop
- `events`: evaluation, anomaly files, checkpoints, loggers, stop signals, the final summary
- `loop`: `Trainer` (the above put together) with its `fit` loop, and `train(cfg)`
- around them: `optim`, `loggers`, `distributed`, `signals`, `runlock`, `threads`, `sweep`
"""
