"""A Python with torch, Hydra and the project already imported, which forks one child per run of a project script.

The tests run `train.py` and the scripts as separate processes some 150 times. Each fresh interpreter spends about
3.5 s importing torch (its optimizers import torch._dynamo) before the run's own work, often a second or two: most
of `make test`'s time. This process pays that once: it imports, then reads one request per line on stdin
(argv, cwd, env, files for stdout and stderr), forks, and the child runs the script as `python SCRIPT ARGS` would
(`runpy`, `__main__`, `sys.argv`, the environment and working directory of the request, its output in the files)
and exits through the interpreter's normal exit, so atexit handlers and exit statuses are those of a real run. The
parent answers the child's PID at once and its exit status when it ends (a negative status: killed by a signal, as
`subprocess` reports it).

The parent never runs a torch operation, so no OpenMP thread pool exists to be broken by the fork. `conftest.py`'s
`python_run` sends the requests; runs that need a fresh interpreter (other import paths, `-c`, several processes at
once) go to `subprocess` as before.
"""

import json
import os
import runpy
import sys
import traceback


def preload() -> None:
    import hydra  # noqa: F401
    import matplotlib

    matplotlib.use(
        "Agg"
    )  # what the scripts choose; importing pyplot here would fix the backend for every child
    import torch
    import torch._dynamo  # noqa: F401  (what the first optimizer would import)

    import wapstable.cli.evaluate  # noqa: F401
    import wapstable.cli.train  # noqa: F401
    import wapstable.data.sources.synthetic  # noqa: F401
    import wapstable.train.loop  # noqa: F401
    import wapstable.train.stages  # noqa: F401

    assert torch.get_num_threads() >= 1  # reads a setting; starts no thread pool


def child(request: dict) -> None:
    """Become `python ARGV...`: never returns (SystemExit leaves through the interpreter's normal exit)."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    argv = request["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def main() -> None:
    # this checkout's code, as `python train.py` here imports it (whatever checkout an editable install points to)
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    preload()
    control = sys.stdout
    while line := sys.stdin.readline():
        request = json.loads(line)
        control.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(request)
        control.write(json.dumps({"pid": pid}) + "\n")
        control.flush()
        _, status = os.waitpid(pid, 0)
        control.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        control.flush()


if __name__ == "__main__":
    main()
