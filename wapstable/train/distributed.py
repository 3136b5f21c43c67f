"""Multi-process training (torchrun + DDP): rank bookkeeping and the collectives the guard needs.

With `trainer.ddp=false` every method is a cheap no-op, so the trainer has one code path. Under DDP every rank
takes the same decision at every step, or the replicas drift apart silently:
- skip: the non-finite flag is all-reduced (MAX), so all ranks skip the step any one of them found bad;
- which ranks saw it: a comm hook checks each rank's own gradients before DDP averages them (after averaging, one
  NaN is on every rank), and the anomaly checkpoint holds the batch of the first rank that saw it;
- drift: every `trainer.consistency_every` steps the ranks compare an exact checksum of their weights.
"""

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from wapstable.device import resolve_device
from wapstable.errors import TrainingStopped, UserError

log = logging.getLogger(__name__)

# Integer views of each float width: a weight's raw bits, summed exactly.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weight_checksums(model: torch.nn.Module) -> torch.Tensor:
    """One int64 per parameter: the sum of its raw bits.

    Integer sums are exact and order-free, so equal weights give equal checksums whatever the device, the thread
    count or the reduction order (a float sum can differ in its last bit with any of those), and one flipped bit
    changes the sum. Buffers are left out: DDP broadcasts them from rank 0 at each forward, and in between each rank
    updates BatchNorm's running statistics with its own batch, so they differ legitimately.
    """
    with torch.no_grad():
        sums = [p.detach().view(_BITS[p.element_size()]).sum(dtype=torch.int64) for p in model.parameters()]
    return torch.stack(sums)


class _GradFlag:
    """State of the comm hook: does this rank's own gradient hold NaN/Inf (a device bool, no host sync)?"""

    def __init__(self, device: torch.device):
        self.bad = torch.zeros((), dtype=torch.bool, device=device)


def _flag_and_allreduce(state: _GradFlag, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (mean), after noting whether this rank's gradient bucket was finite."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.bad |= ~torch.isfinite(bucket.buffer()).all()
    return allreduce_hook(None, bucket)


class Dist:
    def __init__(self, rank: int = 0, world_size: int = 1, device: torch.device | None = None):
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cpu")
        self._grads = _GradFlag(self.device)
        self._grads_last = torch.zeros((), dtype=torch.bool, device=self.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.enabled:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids)
        ddp.register_comm_hook(self._grads, _flag_and_allreduce)
        return ddp

    def any(self, flag: torch.Tensor) -> torch.Tensor:
        """True on every rank if `flag` is true on any rank (one all-reduce of one number).

        Called once per step after backward; it also closes the step's record of this rank's own gradients
        (`local_grads_nonfinite`) and resets it for the next backward.
        """
        if not self.enabled:
            return flag
        self._grads_last, self._grads.bad = self._grads.bad, torch.zeros_like(self._grads.bad)
        value = flag.to(torch.float32).reshape(1).clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value[0] > 0

    @property
    def local_grads_nonfinite(self) -> bool:
        """Did this rank's own gradients (before DDP averaged them) hold NaN/Inf at the last step?"""
        return bool(self._grads_last)

    def agree(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank: for host-side decisions (a spike, a stop request)."""
        if not self.enabled:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value[0] > 0)

    def ranks_with(self, flag: bool) -> list[int]:
        """The ranks on which `flag` is true (all-reduced; every rank must call it)."""
        if not self.enabled:
            return [0] if flag else []
        flags = torch.zeros(self.world_size, device=self.device)
        flags[self.rank] = float(flag)
        dist.all_reduce(flags)
        return [r for r in range(self.world_size) if flags[r] > 0]

    def from_rank(self, src: int, obj):
        """`obj` as rank `src` has it, on every rank (a pickled broadcast; every rank must call it)."""
        if not self.enabled:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def should_check(self, step: int, every: int) -> bool:
        return self.enabled and every > 0 and step % every == 0

    def check_consistency(self, model: torch.nn.Module, step: int) -> None:
        """Stop the run if the ranks' weights, or their step counters, differ.

        fairseq compares grad norms across ranks at every step; this compares the weights themselves, every
        `trainer.consistency_every` steps. Drift persists once it happens, so a periodic check still catches it,
        and the weights catch every cause (a rank that stepped while another skipped, a per-rank fault, a
        nondeterministic optimizer, a bit flip, a rank resumed from another checkpoint), while grad norms miss
        all but a bad all-reduce. The check is exact (integer bit sums, see `weight_checksums`) and costs one
        all-gather of one int64 per parameter tensor. It also runs once before the first step, where it catches
        ranks that resumed from different checkpoints before their step counters misalign the collectives.
        """
        if not self.enabled:
            return
        local = torch.cat([torch.tensor([step], device=self.device), weight_checksums(model).to(self.device)])
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        table = torch.stack(gathered).cpu()  # (world, 1 + parameters)
        differ = (table != table[0]).any(dim=0)
        if not differ.any():
            log.debug(
                "step %d: weights identical on %d ranks (checksum %x)", step, self.world_size, _fold(table[0])
            )
            return
        steps = table[:, 0].tolist()
        if differ[0]:
            raise TrainingStopped(
                f"the ranks are at different steps ({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}): "
                "they resumed from different checkpoints; every rank must see the same run directory "
                "(a shared filesystem across machines, and the same hydra.run.dir)"
            )
        names = [n for n, _ in model.named_parameters()]
        bad = [names[i - 1] for i in differ.nonzero().flatten().tolist()]
        odd = [r for r in range(self.world_size) if (table[r] != table[0]).any()]
        raise TrainingStopped(
            f"step {step}: the weights differ across ranks: {len(bad)} of {len(names)} parameter tensors "
            f"(first {bad[0]}) differ between rank 0 and rank(s) {odd}; the replicas have diverged, so the run "
            "stops here rather than train them apart (a per-rank fault, or a rank that stepped while another "
            "skipped); resume from the last checkpoint, which rank 0 wrote"
        )

    def cleanup(self) -> None:
        if self.enabled and dist.is_initialized():
            # Every rank reaches the end before the group goes: a rank tearing gloo down while another still
            # talks to it can abort the process ("terminate called without an active exception").
            with contextlib.suppress(RuntimeError):
                dist.barrier()
            dist.destroy_process_group()


def _fold(row: torch.Tensor) -> int:
    """The per-parameter checksums folded into one number for the log."""
    h = 0
    for v in row.tolist():
        h = (h * 1000003 ^ v) & 0xFFFFFFFFFFFF
    return h


def setup(ddp: bool, device_name: str = "auto") -> Dist:
    """Join the process group torchrun describes in the environment, or a single-process Dist."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not ddp:
        if world > 1:
            raise UserError(
                f"torchrun started {world} processes but trainer.ddp=false, so each would train alone into the "
                "same run directory; add trainer.ddp=true"
            )
        return Dist()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "trainer.ddp=true needs torchrun: `torchrun --nproc_per_node=N train.py trainer.ddp=true "
            "hydra.run.dir=outputs/NAME`"
        )
    use_cuda = resolve_device(device_name).type == "cuda"  # each rank then takes its own GPU, cuda:LOCAL_RANK
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if use_cuda:
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    log.info("rank %d of %d on %s (%s)", rank, world, device, dist.get_backend())
    return Dist(rank, world, device)


def torchrun_argv(argv: list[str]) -> list[str]:
    """The command line of a process torchrun started, for `train.py` to hand to Hydra.

    Every rank runs Hydra, and each would compute its own `${now:...}` run directory (different ones when the ranks
    start a second apart), so the run directory must be given. Rank 0 writes `.hydra/` and `train.log` there as
    usual; the other ranks write no `.hydra/` and log to `train.rank<R>.log` beside it (a rank's own warnings,
    such as which rank saw a NaN, live only in its log).
    """
    args = argv[1:]
    if any(a in ("-m", "--multirun") for a in args):
        raise UserError(
            "torchrun runs one training; start sweeps without torchrun (`python train.py -m ...`)"
        )
    if not any(a.lstrip("+").startswith("hydra.run.dir=") for a in args):
        raise UserError(
            "under torchrun every rank must write to the same run directory: add hydra.run.dir=outputs/NAME "
            "(on a filesystem that every machine sees, when there are several)"
        )
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        return argv
    return [
        *argv,
        "hydra.output_subdir=null",
        f"hydra.job_logging.handlers.file.filename=${{hydra.runtime.output_dir}}/${{hydra.job.name}}.rank{rank}.log",
    ]
