"""wapstable's Optuna sweeper for Hydra: `python train.py -m hparams_search=optuna` (see `optuna_sweeper.py`)."""
