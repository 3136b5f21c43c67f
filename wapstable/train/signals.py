"""Stopping at a step boundary on SIGTERM or a cluster's preemption signal, and handing over to submitit's requeue.

SLURM signals a job before its time limit or on preemption; submitit asks for SIGUSR2 (`signal_delay_s` before the
limit; `SUBMITIT_PREEMPT_SIGNAL` names another) and installs a handler that calls the task's checkpoint hook
(Hydra's submitit launcher resubmits the same job), requeues it and exits. Training must not be cut mid-step by
that handler: `StopSignals` takes both signals over for the length of the loop, the loop ends after the current
step and writes `last.pt`, and only then is submitit's handler called, which requeues the job. The requeued job
runs the same command: with `resume=auto` it continues from `last.pt`, bit-identical to an uninterrupted run.
"""

import contextlib
import os
import signal

EXIT_TERMINATED = 143  # SIGTERM: last.pt written, not finished (128 + SIGTERM, what a shell reports)
EXIT_REQUEUE = 144  # the preemption signal with no submitit to hand over to: last.pt written, requeue me
# (144 is what submitit's local executor reads as "requeue this job")


def preemption_signal() -> signal.Signals | None:
    name = "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return getattr(signal, name, getattr(signal, "SIGUSR2", None))


class StopSignals:
    """Within `with`, SIGTERM and the preemption signal only set `received`; the loop stops at a step boundary."""

    def __init__(self):
        self.received: signal.Signals | None = None
        self.previous: dict = {}
        self.preempt = preemption_signal()

    def __enter__(self):
        for sig in {getattr(signal, "SIGTERM", None), self.preempt} - {None}:
            with contextlib.suppress(ValueError):  # not in the main thread: leave signals alone
                self.previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        self.received = signal.Signals(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @property
    def name(self) -> str:
        return self.received.name if self.received is not None else "a stop request"

    @property
    def exit_code(self) -> int:
        return EXIT_REQUEUE if self.received == self.preempt else EXIT_TERMINATED

    def hand_over(self) -> None:
        """After the checkpoint: the preemption handler that was in place before (submitit's) requeues the job
        and exits; with none, the caller exits with EXIT_REQUEUE."""
        handler = self.previous.get(self.preempt)
        if self.received == self.preempt and callable(handler):
            handler(int(self.received), None)
