"""Multi-process training (torchrun + DDP): rank bookkeeping and the collectives the guard needs.

With `trainer.ddp=false` every method is a cheap no-op, so the trainer has one code path.
"""

import logging
import os

import torch
import torch.distributed as dist

from .errors import UserError

log = logging.getLogger(__name__)


class Dist:
    def __init__(self, rank: int = 0, world_size: int = 1, device: torch.device | None = None):
        self.rank, self.world_size = rank, world_size
        self.device = device or torch.device("cpu")

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
        return DistributedDataParallel(model, device_ids=ids)

    def any(self, flag: torch.Tensor) -> torch.Tensor:
        """True on every rank if `flag` is true on any rank (one all-reduce of one number)."""
        if not self.enabled:
            return flag
        value = flag.to(torch.float32).reshape(1).clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value[0] > 0

    def ranks_with(self, flag: bool) -> list[int]:
        """The ranks on which `flag` is true (all-gathered)."""
        if not self.enabled:
            return [0] if flag else []
        flags = torch.zeros(self.world_size, device=self.device)
        flags[self.rank] = float(flag)
        dist.all_reduce(flags)
        return [r for r in range(self.world_size) if flags[r] > 0]

    def should_check(self, step: int, every: int) -> bool:
        return self.enabled and every > 0 and step % every == 0

    def check_consistency(self, model: torch.nn.Module, step: int) -> None:
        """Compare a cheap checksum of the weights across ranks; a mismatch stops the run."""
        with torch.no_grad():
            local = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        values = [float(g) for g in gathered]
        if any(v != values[0] for v in values):
            raise RuntimeError(
                f"step {step}: the weights differ across ranks (checksums {values}); the replicas have diverged"
            )

    def cleanup(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def setup(ddp: bool, device_name: str = "auto") -> Dist:
    """Join the process group torchrun describes in the environment, or a single-process Dist."""
    if not ddp:
        return Dist()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "trainer.ddp=true needs torchrun: `torchrun --nproc_per_node=N train.py trainer.ddp=true`"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available() and device_name != "cpu"
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    log.info("rank %d of %d on %s", rank, world, device)
    return Dist(rank, world, device)
