"""The drift guard: DDP's ranks train one model, checked rather than assumed.

DDP keeps its copies equal by construction only: a model built differently on one rank, other
checkpoint or data files on one machine, or a weight changed outside the optimizer step make each
rank train a model of its own, unnoticed. Hence `check_start`, `check_first_batch` and
`DriftGuard`, one collective each, comparing tensors by a `fingerprint`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterable, Iterator, Sequence
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
    """Each tensor's bits summed as int64 where it lives: exact on any device, and changed by a
    change in any element (short of one that cancels it, or a swap within a tensor)."""
    real = (torch.view_as_real(t) if t.is_complex() else t for t in tensors)
    return [t.detach().view(BITS[t.element_size()]).sum(dtype=torch.int64) for t in real]


def digest(tensor: torch.Tensor) -> str:
    """A hash of a tensor's dtype, shape and elements in their order, to gather in place of a
    batch's targets: unlike `fingerprint`, it tells the same targets in another order apart."""
    bits = tensor.detach().cpu().contiguous()
    bits = torch.view_as_real(bits) if bits.is_complex() else bits
    hashed = hashlib.sha256(f"{bits.dtype} {list(bits.shape)}".encode())
    hashed.update(bits.view(BITS[bits.element_size()]).numpy().tobytes())
    return hashed.hexdigest()


def differing(process: Process, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """The names in `named` (alike on every rank) whose tensors differ from rank 0's: the first rank
    where each does."""
    if not process.in_group or not named:
        return {}
    mine = torch.stack(fingerprint(tensor for _, tensor in named))
    ranks = torch.stack(process.all_gather(mine))  # ranks × tensors
    differs = (ranks != ranks[0]).cpu()
    return {
        named[i][0]: int(differs[:, i].nonzero()[0])
        for i in differs.any(dim=0).nonzero().flatten().tolist()
    }


def check_start(model: nn.Module, process: Process) -> None:
    """Every rank's state dict is rank 0's, before DDP copies rank 0's over it (hiding drift)."""
    if not process.in_group:
        return
    named = list(model.state_dict().items())
    shapes = [f"{name} {list(tensor.shape)}" for name, tensor in named]
    sums = torch.stack(fingerprint(t for _, t in named)).tolist() if named else []
    (first_shapes, first_sums), *others = process.all_gather_object((shapes, sums))
    for rank, (their_shapes, their_sums) in enumerate(others, start=1):
        if their_shapes != first_shapes:
            pairs = zip_longest(first_shapes, their_shapes, fillvalue="nothing")
            ours, theirs = next((a, b) for a, b in pairs if a != b)
            raise UserError(
                f"DDP rank {rank} built another model than rank 0 (it has {theirs} where rank 0 "
                f"has {ours}). Build the same model on every rank: nothing in it may depend on "
                "the rank or the machine."
            )
        if their_sums != first_sums:
            pairs = zip(named, first_sums, their_sums, strict=True)
            name = next(n for (n, _), a, b in pairs if a != b)
            raise UserError(
                f"DDP rank {rank} starts from other weights than rank 0 ({name} differs). DDP "
                "would copy rank 0's over them and hide whatever made them differ: a seed that "
                "depends on the rank, or a checkpoint (init_from, resume) that differs between "
                "machines. Build the model alike on every rank (src/engine/run.py seeds cfg.seed "
                "before building it), from the same checkpoint file."
            )


def check_first_batch(data: Data, process: Process) -> None:
    """The ranks' shares of epoch 1's first global batch are disjoint, make it up, and read the same
    targets (every rank decides on the same gathered values)."""
    if not process.in_group:
        return
    sampler = copy.copy(data.sampler)
    sampler.set_epoch(1)
    batch = sampler.permutation()[: data.batch_size]
    share = next(sampler.index_batches())
    labels = labels_of(data.train)  # None for a dataset that reads them sample by sample only
    read = None if labels is None else digest(labels[batch.to(labels.device)])
    everyone = process.all_gather_object((data.size("train"), share.tolist(), read))
    sizes = [size for size, _, _ in everyone]
    if len(set(sizes)) > 1:
        raise UserError(
            f"The DDP ranks hold different training splits ({sizes} images, in rank order): "
            "every machine needs the same data files in data.root."
        )
    taken = [index for _, indices, _ in everyone for index in indices]
    if sorted(taken) != sorted(batch.tolist()):
        twice = sorted({i for i in taken if taken.count(i) > 1})
        missing = sorted(set(batch.tolist()) - set(taken))
        raise UserError(
            f"The DDP ranks' shares of the first global batch overlap (images {twice[:5]} are in "
            f"two shares) or leave images out ({missing[:5]}): each rank must take its own part "
            "of every batch. Check changes to GlobalBatchSampler in src/engine/data.py."
        )
    for rank, (_, _, their_labels) in enumerate(everyone[1:], start=1):
        if their_labels != everyone[0][2]:
            raise UserError(
                f"DDP rank {rank} reads other labels for the first batch than rank 0 does: the "
                "machines have different data files. Give every machine the same data in "
                "data.root."
            )


class DriftGuard(Hook):
    """`parallel.check_sync_every_n_steps` under DDP: stop every rank when a parameter differs from
    rank 0's, checked before each evaluation or save ("eval"), and also every N steps (N)."""

    def __init__(self, every: int | str) -> None:
        self.every = every

    @contextlib.contextmanager
    def active(self, run: Run, parts: Parts, progress: Progress) -> Iterator[None]:
        self.model = parts.model
        yield

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
