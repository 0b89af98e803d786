"""The drift guard: DDP's ranks train one model, checked (one collective each) rather than assumed.
A model built differently on one rank, other checkpoint or data files on one machine, or a weight
changed outside the optimizer step would make each rank train its own model, unnoticed."""

import copy
import hashlib
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from itertools import zip_longest

import torch
from hydra.errors import CompactHydraException
from torch import nn

from src.engine.core.context import Hook, Run
from src.engine.core.state import Parts, Progress
from src.engine.data import Data, labels_of
from src.engine.errors import UserError
from src.engine.guards.checks import intact
from src.engine.parallel import Process

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by element size


class Drifted(CompactHydraException):
    """The DDP ranks' parameters stopped being equal during training."""


def fingerprint(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's bits summed as int64 where it lives: exact anywhere, changed by any change."""
    real = (torch.view_as_real(t) if t.is_complex() else t for t in tensors)
    return [t.detach().view(BITS[t.element_size()]).sum(dtype=torch.int64) for t in real]


def digest(tensor: torch.Tensor) -> str:
    """A hash of dtype, shape and elements: unlike `fingerprint`, it tells another order apart."""
    bits = tensor.detach().cpu().contiguous()
    head = f"{bits.dtype} {list(bits.shape)}".encode()
    return hashlib.sha256(head + bits.flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def differing(process: Process, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Each name in `named` whose tensor differs from rank 0's somewhere: the first rank it does."""
    if not process.in_group or not named:
        return {}
    ranks = torch.stack(process.all_gather(torch.stack(fingerprint(t for _, t in named))))
    first = (ranks != ranks[0]).int().argmax(dim=0).tolist()  # per tensor; 0: the same everywhere
    return {name: rank for (name, _), rank in zip(named, first, strict=True) if rank}


def check_start(model: nn.Module, process: Process) -> None:
    """Every rank's state dict is rank 0's, before DDP copies rank 0's over it (hiding drift)."""
    if not process.in_group:
        return
    state = model.state_dict()
    shapes = [f"{name} {list(tensor.shape)}" for name, tensor in state.items()]
    sums = torch.stack(fingerprint(state.values())).tolist() if state else []
    (first_shapes, first_sums), *others = process.all_gather_object((shapes, sums))
    for rank, (their_shapes, their_sums) in enumerate(others, start=1):
        if their_shapes != first_shapes:
            pairs = zip_longest(first_shapes, their_shapes, fillvalue="nothing")
            ours, theirs = next((a, b) for a, b in pairs if a != b)
            raise UserError(
                f"DDP rank {rank} built another model than rank 0 (it has {theirs} where rank 0 "
                f"has {ours}): nothing in the model may depend on the rank or the machine."
            )
        if their_sums != first_sums:
            name = next(n for n, a, b in zip(state, first_sums, their_sums, strict=True) if a != b)
            raise UserError(
                f"DDP rank {rank} starts from other weights than rank 0 ({name} differs). DDP "
                "would copy rank 0's over them and hide whatever made them differ: a seed that "
                "depends on the rank, or a checkpoint (init_from, resume) that differs between "
                "machines. Build the model alike on every rank, from the same checkpoint file."
            )


def check_first_batch(data: Data, process: Process) -> None:
    """Epoch 1's first batch: the ranks' shares are disjoint, make it up, read the same targets."""
    if not process.in_group:
        return
    sampler = copy.copy(data.sampler)
    sampler.set_epoch(1)
    batch, share = sampler.permutation()[: data.batch_size], next(sampler.index_batches())
    labels = labels_of(data.train)  # None for a dataset that reads them sample by sample only
    read = None if labels is None else digest(labels[batch.to(labels.device)])
    everyone = process.all_gather_object((data.size("train"), share.tolist(), read))
    sizes, shares, reads = zip(*everyone, strict=True)
    if len(set(sizes)) > 1:
        raise UserError(
            f"The DDP ranks hold different training splits ({list(sizes)} images, in rank order): "
            "every machine needs the same data files in data.root."
        )
    taken = [index for indices in shares for index in indices]
    if sorted(taken) != sorted(batch.tolist()):
        twice = sorted({i for i in taken if taken.count(i) > 1})
        missing = sorted(set(batch.tolist()) - set(taken))
        raise UserError(
            f"The DDP ranks' shares of the first global batch overlap (images {twice[:5]} are in "
            f"two shares) or leave images out ({missing[:5]}): each rank must take its own part "
            "of every batch. Check changes to GlobalBatchSampler in src/engine/data.py."
        )
    if rank := next((r for r, theirs in enumerate(reads) if theirs != reads[0]), 0):
        raise UserError(
            f"DDP rank {rank} reads other labels for the first batch than rank 0 does: give every "
            "machine the same data files in data.root."
        )


class DriftGuard(Hook):
    """Stop every rank when a parameter differs from rank 0's: at each check, and every N steps."""

    def __init__(self, every: int | str) -> None:
        self.every = every

    def active(self, run: Run, parts: Parts, progress: Progress) -> AbstractContextManager:
        self.model = parts.model
        return nullcontext()

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        if isinstance(self.every, int) and progress.step % self.every == 0:
            self.agreed(run, progress, [], self.model)

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        named = list(run.strategy.unwrap(weights).named_parameters()) if weights is not None else []
        if drifted := differing(run.process, named):
            name, rank = next(iter(drifted.items()))
            raise Drifted(
                f"Stopped at step {progress.step}: DDP rank {rank}'s {name} differs from rank 0's, "
                "so the ranks no longer train one model, and nothing after it was saved "
                f"({intact(run)}). Some code changes weights outside the optimizer step, on some "
                "ranks only: run python train.py debug=equivalence with this run's overrides to "
                "find it."
            )
