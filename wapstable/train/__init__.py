"""The training run, as named parts that call nothing back (so no circle of calls):

- `build`: config -> data, model and the checks that run before a file is written
- `parts`: `RunParts`, every component of a run built from its config (`build_parts`)
- `record`: `RunRecord`, what the run has done (step, clock, validations, best, anomalies)
- `checkpointer`: the run's state, saved (checkpoints, anomaly files) and loaded (resume, rollback, reset)
- `evaluator`: validation and the final test; `runlog`: loggers, progress bar, train.log; `summary`: metrics.json
- `loop`: `Trainer`, which takes the guarded steps and decides what follows each (evaluation, checkpoint, rollback, stop)
- `stages`: a command as a list of stages (the pretraining, then the run) and `train(cfg)`
- around them: `optim`, `schedules`, `loggers`, `distributed`, `signals`, `runlock`, `threads`, `sweep`
"""
