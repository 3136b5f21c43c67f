"""Check the trainer's CUDA paths on one GPU: `python scripts/gpu_check.py [--quick] [--device cpu] [overrides]`.

The same as the installed `wapstable-gpu-check` and `make gpu-check`; the code and its documentation are in
`wapstable/cli/gpu_check.py`.
"""

from wapstable.cli.gpu_check import main, run

__all__ = ["main", "run"]  # main(argv) returns the exit status, for callers in Python

if __name__ == "__main__":
    run()
