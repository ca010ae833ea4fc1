"""The processes of a run and how they share work: regeneration, the feature cache and each
checkpoint's evaluation are split across the ranks, and the pieces are gathered.

`Ranks` is a run's rank and world size with the three collectives the shared work needs
(barrier, gather, broadcast), over the default torch.distributed process group that
accelerate creates; a single process (no group) has world size 1 and the collectives return
at once. Every collective waits at most the group's timeout (`train.dist_timeout_s`,
`make_accelerator`): the work between two collectives is one rank's share, so a rank waits
for the slowest rank's share, never for all the work done by one rank.

Splits are by index and the same in every rank, so the gathered result is assembled in the
order a single process would produce it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

DEFAULT_TIMEOUT_S = 7200  # train.dist_timeout_s unset: 2 hours per collective


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> Ranks:
        """The default process group's rank and size; one process when there is none."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mine(self, n: int) -> list[int]:
        """This rank's share of n items, indices rank, rank + world, ..."""
        return list(range(self.rank, n, self.world))

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def gather(self, obj: object) -> list:
        """Every rank's `obj` (picklable; tensors on the CPU), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's `seconds`, on every rank: one clock for a step that
        ends when its slowest rank ends (the time budget and the LR schedule read it)."""
        return seconds if self.world == 1 else max(self.gather(float(seconds)))

    def broadcast(self, obj: object) -> object:
        """Rank 0's `obj` on every rank (the others pass anything, e.g. None)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def dist_timeout(seconds: float | None) -> timedelta:
    """train.dist_timeout_s as the process group's timeout; refused unless positive."""
    seconds = DEFAULT_TIMEOUT_S if seconds is None else seconds
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds <= 0:
        raise ValueError(
            f"train.dist_timeout_s={seconds!r}: the seconds a collective may wait for the other "
            f"ranks must be a positive number; e.g. train.dist_timeout_s={DEFAULT_TIMEOUT_S}"
        )
    return timedelta(seconds=float(seconds))
