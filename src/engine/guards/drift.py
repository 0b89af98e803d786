"""The drift guard: DDP's ranks train one model, checked rather than assumed.

DDP keeps its copies of the model equal by construction only: every rank starts from the same
weights, trains on its own part of the same global batch and applies the same averaged gradients.
Nothing notices when that breaks (a model built differently on one rank, a checkpoint or data
files that differ between machines, a weight changed outside the optimizer step on one rank):
each rank then trains a model of its own, and rank 0's checkpoint is one of several. So, under
DDP, with one collective each:

- `check_start`: before DDP copies rank 0's weights over the others' (which would hide the
  difference), every rank's weights and buffers equal rank 0's;
- `check_first_batch`: the ranks' shares of the first global batch are disjoint, make up that
  batch, and hold the same targets on every rank (compared by a hash, whatever their shape);
- `check_in_sync`: during training (`parallel.check_sync_every_n_steps`), the parameters still
  equal rank 0's.

Tensors are compared by a fingerprint, the sum of each tensor's bit patterns read as integers:
exact (integer sums do not depend on their order, on any device), one number per tensor,
computed where the tensor lives.
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
    """Each tensor's bits summed as int64: equal for equal tensors, and changed by a change in
    any element (short of another change that cancels it exactly; elements swapped within a
    tensor, a kind of drift no step makes, keep it)."""
    real = (torch.view_as_real(t) if t.is_complex() else t for t in tensors)
    return [t.detach().view(BITS[t.element_size()]).sum(dtype=torch.int64) for t in real]


def digest(tensor: torch.Tensor) -> str:
    """A hash of a tensor's dtype, shape and elements, in their order: a few bytes to gather in
    place of a batch's targets (a label a sample, a token a position). Unlike `fingerprint`'s
    sum, it also tells the same targets in another order, as other files may hold them."""
    bits = tensor.detach().cpu().contiguous()
    bits = torch.view_as_real(bits) if bits.is_complex() else bits
    hashed = hashlib.sha256(f"{bits.dtype} {list(bits.shape)}".encode())
    hashed.update(bits.view(BITS[bits.element_size()]).numpy().tobytes())
    return hashed.hexdigest()


def differing(process: Process, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """The tensors of `named` (the same names, in the same order, on every rank) that differ
    from rank 0's somewhere: each name, in `named`'s order, with the first rank where it does."""
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
    """Every rank's parameters and (persistent) buffers, before DDP wraps the model, are rank
    0's: what the checkpoint saves and DDP would copy over."""
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
    """The ranks' shares of epoch 1's first global batch are disjoint and make up that batch,
    and every rank reads the same targets for it: no sample trained twice or left out, and no
    machine with other data files. Every rank decides on the same gathered values."""
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


def check_in_sync(model: nn.Module, process: Process, step: int, kept: str) -> None:
    """Stop every rank when a parameter differs from rank 0's; `kept` says what is saved."""
    if drifted := differing(process, list(model.named_parameters())):
        name, rank = next(iter(drifted.items()))
        raise Drifted(
            f"Stopped at step {step}: DDP rank {rank}'s {name} differs from rank 0's, so the "
            f"ranks no longer train one model, and nothing after it was saved ({kept}). Some "
            "code changes weights outside the optimizer step, on some ranks only: run python "
            "train.py debug=equivalence with this run's overrides to find it."
        )


class DriftGuard(Hook):
    """`parallel.check_sync_every_n_steps` under DDP: compare the ranks' parameters at each check
    before an evaluation or a save ("eval"), and also every N steps (N)."""

    def __init__(self, every: int | str) -> None:
        self.every = every

    @contextlib.contextmanager
    def active(self, run: Run, parts: Parts, progress: Progress) -> Iterator[None]:
        self.model = parts.model
        yield

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        if isinstance(self.every, int) and progress.step % self.every == 0:
            self.in_sync(run, progress, self.model)

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        if weights is not None:
            self.in_sync(run, progress, weights)

    def in_sync(self, run: Run, progress: Progress, weights: nn.Module) -> None:
        check_in_sync(run.strategy.unwrap(weights), run.process, progress.step, intact(run))
