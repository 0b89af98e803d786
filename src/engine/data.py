"""The data, batched for this process: a dataset class (yours, or `src/datasets.py`'s) reads each
split as (input, target) pairs of any shape and dtype; `Data` holds `train`, `val` (held out of
train) and `test`, and normalises and augments uint8 C×H×W images only. `loader=tensor` gathers
batches by index from tensors on the device, `loader=torch` through a `DataLoader`: the same."""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from src.engine import storage
from src.engine.config import DataKeys
from src.engine.errors import UserError, first_line, where
from src.engine.parallel import Process

log = logging.getLogger(__name__)

Batch = tuple[Tensor, Tensor]  # (inputs, targets)
Split = Batch | Dataset  # a split's (inputs, targets) in memory, or its Dataset

INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)  # class labels


@dataclass
class GlobalBatchSampler:
    """This rank's share, by stride, of each global batch of DistributedSampler's permutation; the
    last, partial batch is split as it is, not padded: an epoch is the same for any world size."""

    num_samples: int
    batch_size: int
    rank: int
    world_size: int
    seed: int
    epoch: int = 0
    skip: int = 0  # batches of the epoch left out: done before a resume

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Epoch `epoch`'s order, leaving out its first `skip` batches (done before a resume)."""
        self.epoch, self.skip = epoch, skip

    def permutation(self) -> Tensor:
        """The epoch's order of all samples: the draw of DistributedSampler(shuffle=True)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def index_batches(self, device: torch.device | None = None) -> Iterator[Tensor]:
        """This rank's shares as index tensors on `device`, cut from one permutation tensor."""
        order, size = self.permutation().to(device), self.batch_size
        for start in range(self.skip * size, self.num_samples, size):
            yield order[start : start + size][self.rank :: self.world_size]

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        return (index.tolist() for index in self.index_batches())


class Data(DataKeys):
    """A dataset's three splits, batched for this process: the data section's keys are `DataKeys`'s
    (src/engine/config.py: their types, defaults and ranges, checked as Data is built). `dataset`
    names the class that reads the files: it gets the keys Data does not take, and those of Data's
    own that it names."""

    def __init__(self, root: str | None = None, **keys: Any):
        options = {key: keys.pop(key) for key in set(keys) - set(DataKeys.__dataclass_fields__)}
        if (loader := keys.get("loader", "tensor")) not in ("tensor", "torch"):
            raise UserError(f"data.loader={loader} is not a loader: use tensor or torch.")
        super().__init__(**keys)  # the schema's defaults, and its checks
        if isinstance(root, str):  # data.root="~/mnist": the user's own folder
            root = os.path.expanduser(root)
        own = {**vars(self), "root": root}  # a dataset class may take some of Data's keys
        try:  # hydra's get_class would log the error before this says it
            module, _, name = self.dataset.rpartition(".")
            if not module:
                raise ImportError("not a dotted path, module.Class")
            source = getattr(importlib.import_module(module), name)
        except Exception as err:  # noqa: BLE001 - what the module raised as it was imported
            raise UserError(
                f"data.dataset={self.dataset} is no class that can be imported "
                f"({first_line(err)}): give a dataset class's dotted path (src.datasets.IDX, or "
                "your own), or choose a data config (python train.py --help lists them).",
                every_rank=True,
            ) from None
        self.takes = set(inspect.signature(source).parameters)
        self.source = source(**{k: v for k, v in own.items() if k in self.takes}, **options)
        self.class_names = list(self.class_names) if self.class_names else None

    @property
    def name(self) -> str:
        """The dataset as messages name it: by its class's `__str__` (where its files were found,
        once they are), else by its class and the class's file."""
        if type(self.source).__str__ is not object.__str__:
            return str(self.source)
        return f"{type(self.source).__name__} ({where(type(self.source))})"

    def setup(
        self,
        process: Process,
        dtype: torch.dtype = torch.float32,
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> None:
        """Find (or download) the files and hold the splits, for a model of `dtype` and layout."""
        check_shares(self.batch_size, process.world_size)
        # One process per machine finds (or downloads) the files and decodes them while the others
        # wait; gathering its verdict is the barrier, and every rank stops on an error.
        error, splits = None, ()
        if process.local_rank == 0:
            try:
                self.source.prepare()
                splits = self._read("train"), self._read("test")
            except UserError as err:
                error = str(err)
        if error := storage.agree(process, error):
            raise UserError(error, every_rank=True)
        self.device, self.rank, self.world_size = process.device, process.rank, process.world_size
        self.dtype, self.memory_format = dtype, memory_format
        self._hold(*(splits or (self._read("train"), self._read("test"))))
        self._describe()
        self.sampler = GlobalBatchSampler(
            self.size("train"), self.batch_size, self.rank, self.world_size, self.seed
        )
        self.steps_per_epoch = len(self.sampler)
        self.normalise = self._normalisation() if self.is_image else self._as_dtype
        self.augmentation = None
        if self.augment and self.is_image:  # other inputs: the dataset class augments them
            pad = max(self.image_size // 8, 1)
            self.augmentation = Augment(pad, self.seed, self.rank, self.world_size)
        if self.loader == "torch":
            self._data_loaders()
        what = f"images of {'×'.join(map(str, self.shape))}"
        if not self.is_image:
            targets = kind(self.target_dtype, self.target_shape)
            what = f"samples of {kind(self.input_dtype, self.input_shape)} (targets {targets})"
        evaluated = f" (data.eval_subset={self.eval_subset}: the first of each split evaluated)"
        log.info(
            "Data: %d training, %d validation (data.val_size) and %d test %s from %s%s",
            *(self.size(split) for split in ("train", "val", "test")),
            what,
            self.name,
            evaluated if self.eval_subset else "",
        )
        if self.rank == 0 and self.batch_size > self.size("train"):
            log.warning(
                "data.batch_size=%d is more than the %d training samples: each step takes them "
                "all, one step an epoch. Lower data.batch_size for more steps.",
                self.batch_size,
                self.size("train"),
            )
        if self.rank == 0 and self.num_classes == 1:
            log.warning(
                "%s holds one class: a classifier is right from the start and learns nothing. "
                "Give it two classes or more.",
                self.name,
            )

    def _data_loaders(self) -> None:
        """loader=torch: DataLoaders of the training order and of each rank's evaluation share."""
        empty, persistent = self.empty_batch(), self.persistent_workers and self.num_workers > 0
        loader = functools.partial(DataLoader, collate_fn=functools.partial(collate, empty=empty),
                                   num_workers=self.num_workers, pin_memory=self.pin_memory,
                                   persistent_workers=persistent)  # fmt: skip
        self.loaders = {"train": loader(self.train, batch_sampler=self.sampler)}
        for split in ("val", "test"):  # this rank's every world_size-th sample, as `_raw` takes
            mine = Subset(getattr(self, split), range(self.rank, self.size(split), self.world_size))
            self.loaders[split] = loader(mine, batch_size=self.test_batch_size)

    def _read(self, name: str) -> Split:
        """A split as the loader holds it: decoded into tensors, or the Dataset itself."""
        dataset = self.source.split(name)
        if len(sample := dataset[0]) != 2:
            raise UserError(
                f"Sample 0 of the {name} split of {self.name} has {len(sample)} parts: a "
                "dataset gives (input, target) pairs. Return each sample's input and target alone."
            )
        if self.loader == "torch":
            return dataset
        if isinstance(dataset, TensorDataset):  # torch's own: its `tensors` a tuple
            return dataset.tensors
        if hasattr(self.source, "cache_path"):
            return cached(self.source, name, dataset, self.name)
        return decode(dataset, name, self.name)

    def _hold(self, train: Split, test: Split) -> None:
        """The validation split carved out of `train`; tensors moved to the training device."""
        count = len(train[1]) if isinstance(train, tuple) else len(train)
        if isinstance(self.val_size, float):  # a share of the training split
            self.val_size = round(self.val_size * count)
        if self.val_size >= count:
            raise UserError(
                f"data.val_size={self.val_size} leaves no training images: the training split "
                f"of {self.name} holds {count}. Hold out fewer (0 for none)."
            )
        # Positions in the training split, drawn by split_seed alone; `subset` takes the first.
        order = torch.randperm(count, generator=torch.Generator().manual_seed(self.split_seed))
        self.train_index = order[self.val_size :].sort().values[: self.subset]
        self.val_index = order[: self.val_size].sort().values[: self.eval_subset]

        def cut(index: Tensor, split: Split = train) -> Split:  # on the CPU: held once
            if isinstance(split, tuple):
                return tuple(t.index_select(0, index).to(self.device) for t in split)
            return Subset(split, index.tolist())

        self.train, self.val = cut(self.train_index), cut(self.val_index)
        if self.eval_subset is not None:  # the first N test samples
            count = len(test[1]) if isinstance(test, tuple) else len(test)
            test = cut(torch.arange(min(self.eval_subset, count)), test)
        self.test = tuple(t.to(self.device) for t in test) if isinstance(test, tuple) else test

    def _describe(self) -> None:
        """The samples' kind (image or not, shapes, dtypes) and classes, checked with the config."""
        held = tuple(t[0] for t in self.train) if isinstance(self.train, tuple) else self.train[0]
        first, target = (torch.as_tensor(t) for t in held)
        self.input_shape, self.input_dtype = tuple(first.shape), first.dtype
        self.target_shape, self.target_dtype = tuple(target.shape), target.dtype
        self.shape, self.is_image = self.input_shape, is_image(first)
        self.in_channels, self.image_size = self.shape[:2] if self.is_image else (None, None)
        if not self.is_image:
            self._refuse_image_keys()
        classes = self.source.classes
        labels = self.target_dtype in INTEGERS  # class labels, one per sample or per position
        if self.num_classes is None and (classes or labels):
            self.num_classes = len(classes or ())
        elif classes and len(classes) != self.num_classes:
            raise UserError(
                f"data.num_classes={self.num_classes}, but {self.name} has {len(classes)} "
                f"classes. Set it to {len(classes)}, or to null to take the number found."
            )
        self.class_names = self.class_names or classes
        if self.class_names and self.num_classes and len(self.class_names) != self.num_classes:
            raise UserError(
                f"data.class_names has {len(self.class_names)} names, and {self.name} has "
                f"{self.num_classes} classes: give one name per class, in the order of their "
                "numbers, or null (the names found).",
                every_rank=True,
            )
        for split in ("train", "test") if labels else ():
            found = labels_of(getattr(self, split))
            if found is not None and found.numel() and found.max() >= self.num_classes:
                raise UserError(
                    f"The {split} split of {self.name} has label {found.max().item()}, but "
                    f"data.num_classes={self.num_classes}. Set it to {found.max().item() + 1}."
                )

    def _refuse_image_keys(self) -> None:
        """Refuse image-only keys for other inputs, unless the dataset class takes them."""
        inputs = f"{kind(self.input_dtype, self.input_shape)} inputs"
        keys = [k for k in ("mean", "std") if getattr(self, k) is not None and k not in self.takes]
        if unused := [f"data.{k}={getattr(self, k)}" for k in keys]:
            normalise = "normalises" if len(unused) == 1 else "normalise"
            raise UserError(
                f"{' and '.join(unused)} {normalise} uint8 C×H×W images only, but {self.name} "
                f"gives {inputs}: set data.mean and data.std to null (normalise such inputs in "
                "the dataset class or the model)."
            )
        if self.augment and "augment" not in self.takes:
            raise UserError(
                f"data.augment=true crops and flips uint8 C×H×W images only, but {self.name} "
                f"gives {inputs}: set data.augment=false."
            )

    def _normalisation(self) -> Normalise:
        """data.mean and data.std, or, where they are null, computed from the training images."""
        mean, std = self.mean, self.std
        if mean is None or std is None:
            if isinstance(self.train, tuple):  # the images' tensor, in chunks
                batches = self.train[0].split(4096)
            else:
                loader = DataLoader(
                    self.train, 256, collate_fn=collate, num_workers=self.num_workers
                )
                batches = (images for images, _ in read(loader))
            mean, std = mean_and_std(batches)
            log.info(
                "data.mean=%s data.std=%s, computed from the %d training images: put them in "
                "the config to skip this",
                *([round(v, 4) for v in values] for values in (mean, std)),
                self.size("train"),
            )
            if not all(std):
                raise UserError(
                    f"The training images of {self.name} are all one colour (std {std}): "
                    "nothing to learn from. Check data.root."
                )
            mean = mean if self.mean is None else self.mean  # either may have been given
            std = std if self.std is None else self.std
        # One value for every channel, as torchvision's Normalize takes it, or one per channel.
        mean, std = (
            [v] * self.in_channels if isinstance(v, int | float) else list(v) for v in (mean, std)
        )
        if not len(mean) == len(std) == self.in_channels:
            raise UserError(
                f"data.mean={mean} and data.std={std} need one value per channel: the images "
                f"have {self.in_channels}."
            )
        return Normalise(mean, std, self.device, self.dtype, self.memory_format)

    def _as_dtype(self, inputs: Tensor) -> Tensor:
        """Inputs that are not images: float ones in the run's dtype and layout, others as read."""
        if not inputs.is_floating_point():
            return inputs
        layout = self.memory_format if inputs.ndim == 4 else torch.preserve_format
        return inputs.to(self.dtype, memory_format=layout)

    def empty_batch(self, device: torch.device | None = None) -> Batch:
        """Raw (inputs, targets) of no sample, with the data's sample shapes and dtypes."""
        shapes = ((self.input_shape, self.input_dtype), (self.target_shape, self.target_dtype))
        return tuple(torch.empty(0, *shape, dtype=dtype, device=device) for shape, dtype in shapes)

    def size(self, split: str) -> int:
        """The number of samples of `split` (train, val or test)."""
        held = getattr(self, split)
        return len(held[1]) if isinstance(held, tuple) else len(held)

    def sample(self, split: str, count: int) -> Batch:
        """`count` raw samples of `split`, evenly spaced (a folder lists class after class)."""
        held = getattr(self, split)
        index = torch.linspace(0, self.size(split) - 1, min(count, self.size(split))).long()
        if isinstance(held, tuple):
            return tuple(t.index_select(0, index.to(t.device)).to(self.device) for t in held)
        samples = collate([held[i] for i in index.tolist()], self.empty_batch())
        return tuple(t.to(self.device) for t in samples)

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[tuple[Tensor, Tensor, int]]:
        """This rank's (inputs, targets, global batch size); `skip`: batches a resume is past."""
        self.sampler.set_epoch(epoch, skip)
        size = self.sampler.num_samples  # the training split's
        for step, (inputs, targets) in enumerate(self._raw("train"), start=skip):
            global_size = min(self.batch_size, size - step * self.batch_size)
            if self.augmentation:
                inputs = self.augmentation(inputs, epoch, step, global_size)
            yield self.normalise(inputs), targets, global_size

    def eval_batches(self, split: str, even: bool = False) -> Iterator[Batch]:
        """This rank's every world_size-th sample of `split`; `even`: as many batches as rank 0."""
        for inputs, targets in self._raw(split):
            yield self.normalise(inputs), targets
        if even:
            mine, most = (len(range(r, self.size(split), self.world_size)) for r in (self.rank, 0))
            for _ in range(*(math.ceil(n / self.test_batch_size) for n in (mine, most))):
                inputs, targets = self.empty_batch(self.device)
                yield self.normalise(inputs), targets

    def _raw(self, split: str) -> Iterator[Batch]:
        """This rank's batches of `split` on the training device, as the dataset gives them."""
        if self.loader == "torch":
            for batch in read(self.loaders[split]):  # pinned memory: asynchronous copies
                yield tuple(t.to(self.device, non_blocking=True) for t in batch)
            return
        if split == "train":
            indices = self.sampler.index_batches(self.device)
        else:
            index = torch.arange(self.rank, self.size(split), self.world_size, device=self.device)
            indices = index.split(self.test_batch_size) if len(index) else ()
        for index in indices:  # no per-sample Python
            # index_select: the same rows as inputs[index], several times faster on a CPU.
            yield tuple(t.index_select(0, index) for t in getattr(self, split))


def check_shares(batch_size: int, world_size: int) -> None:
    """Refuse a batch size that `world_size` ranks cannot share equally."""
    if batch_size < 1 or batch_size % world_size:
        raise UserError(
            f"data.batch_size={batch_size} does not divide over {world_size} processes: use a "
            f"multiple of {world_size} (the ranks share it equally).",
            every_rank=True,
        )


def kind(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """A sample's dtype and shape, for messages: `float32 20`, `int64 16`, `uint8 3×32×32`."""
    return f"{str(dtype).removeprefix('torch.')} {'×'.join(map(str, shape)) or 'scalar'}"


class Normalise:
    """uint8 images → float, scaled like torchvision's ToTensor() then Normalize(mean, std)."""

    def __init__(
        self,
        mean: list[float],
        std: list[float],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        memory_format: torch.memory_format = torch.contiguous_format,
    ):
        self.mean, self.std, self.dtype, self.memory_format = mean, std, dtype, memory_format
        # A scalar where the channels agree: faster than a broadcast (5% of an MLP's CPU epoch).
        self._mean, self._std = (
            v[0] if len(set(v)) == 1 else torch.tensor(v, device=device, dtype=dtype).view(-1, 1, 1)
            for v in (mean, std)
        )

    def __call__(self, images: Tensor) -> Tensor:
        # Converted straight into the layout the model takes (channels-last): one copy, not two.
        images = images.to(self.dtype, memory_format=self.memory_format)
        return images.div_(255).sub_(self._mean).div_(self._std)


class Augment:
    """CIFAR's augmentation on the device: a random crop of each image padded by `pad` black pixels,
    and a horizontal flip of half: drawn per global batch from (seed, epoch, step), not per rank."""

    def __init__(self, pad: int, seed: int, rank: int, world_size: int):
        self.pad, self.seed, self.rank, self.world_size = pad, seed, rank, world_size

    def __call__(self, images: Tensor, epoch: int, step: int, global_size: int) -> Tensor:
        # A tuple of ints hashes the same in every process (only str hashing is randomised).
        generator = torch.Generator().manual_seed(hash((self.seed, epoch, step)) & (2**63 - 1))
        shifts = torch.randint(0, 2 * self.pad + 1, (global_size, 2), generator=generator)
        flips = torch.rand(global_size, generator=generator) < 0.5
        shifts, flips = (t[self.rank :: self.world_size].to(images.device) for t in (shifts, flips))
        count, _, height, width = images.shape
        padded = F.pad(images, (self.pad,) * 4)
        rows = shifts[:, :1] + torch.arange(height, device=images.device)  # count×height
        columns = shifts[:, 1:] + torch.arange(width, device=images.device)
        columns = torch.where(flips[:, None], columns.flip(1), columns)  # a flip reads backwards
        batch = torch.arange(count, device=images.device)[:, None, None]
        crops = padded[batch, :, rows[:, :, None], columns[:, None, :]]  # count×H×W×C
        return crops.permute(0, 3, 1, 2).contiguous()


def cached(source, name: str, dataset: Dataset, named: str) -> Batch:
    """A split decoded through a cache file beside the data, rebuilt when the files changed."""
    path, fingerprint = source.cache_path(name), source.fingerprint(dataset)
    if path.is_file():
        try:
            cache = torch.load(path, weights_only=True)
            if cache["fingerprint"] == fingerprint:
                return cache["images"], cache["labels"]
            log.info(
                "%s: the %s images changed since it was written; decoding them again", path, name
            )
        except Exception as err:  # noqa: BLE001 - any unreadable cache is rebuilt the same way
            log.warning("%s cannot be read (%s); decoding the %s images again", path, err, name)
    images, labels = decode(dataset, name, named)
    cache = {"fingerprint": fingerprint, "images": images, "labels": labels}
    try:
        storage.write_atomically(path, lambda file: torch.save(cache, file))
    except OSError as err:
        log.warning("Could not write the cache %s (%s): the next run decodes them again", path, err)
    return images, labels


def decode(dataset: Dataset, split: str, source: str) -> Batch:
    """Every sample of `dataset`, one at a time, into a tensor of inputs and one of targets."""
    first = [torch.as_tensor(part) for part in dataset[0]]
    noun = "images" if is_image(first[0]) else "samples"
    log.info("Decoding the %d %s %s of %s into memory", len(dataset), split, noun, source)
    inputs, targets = (torch.empty(len(dataset), *t.shape, dtype=t.dtype) for t in first)
    for i in range(len(dataset)):
        sample = [torch.as_tensor(part) for part in dataset[i]]
        for part, got, want in zip(("input", "target"), sample, first, strict=True):
            if (got.shape, got.dtype) != (want.shape, want.dtype):
                needs = "one size (data.image_size)" if is_image(want) else "one shape and dtype"
                raise UserError(
                    f"Sample {i} of the {split} split of {source} has the {part} "
                    f"{kind(got.dtype, got.shape)} and sample 0 {kind(want.dtype, want.shape)}: "
                    f"the fast path needs {needs}."
                )
        inputs[i], targets[i] = sample
    return inputs, targets


def is_image(input: Tensor) -> bool:
    """One sample's input is an image, for the image pipeline: uint8 C×H×W."""
    return input.dtype == torch.uint8 and input.dim() == 3


def mean_and_std(batches: Iterator[Tensor]) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of uint8 images (0-1 scale), exact in integers for any batching."""
    total = squares = count = 0
    for images in batches:
        pixels = images.transpose(0, 1).flatten(1).long()  # C×(N·H·W)
        total = total + pixels.sum(1).cpu()
        squares = squares + pixels.square().sum(1).cpu()
        count += pixels.shape[1]
    mean = total.double() / count
    std = (squares.double() / count - mean.square()).clamp(min=0).sqrt()
    return (mean / 255).tolist(), (std / 255).tolist()


def labels_of(split: Split) -> Tensor | None:
    """A split's targets, where they are known without reading its inputs."""
    if isinstance(split, tuple):
        return split[1]
    if isinstance(split, Subset):
        labels = labels_of(split.dataset)
        return None if labels is None else labels[torch.as_tensor(split.indices, dtype=torch.long)]
    labels = getattr(split, "labels", getattr(split, "targets", None))
    return None if labels is None else torch.as_tensor(labels)


def read(loader: DataLoader) -> Iterator[Batch]:
    """The batches of `loader`; a worker's UserError said in its sentence, not its traceback."""
    try:
        yield from loader
    except UserError as err:
        raise UserError(str(err).rstrip().rsplit("UserError: ", 1)[-1]) from None


def collate(samples: list[tuple[object, object]], empty: Batch | None = None) -> Batch:
    """Stack samples into a batch, each part keeping its dtype; no samples: a copy of `empty`."""
    if not samples:
        return tuple(t.clone() for t in empty)
    inputs, targets = zip(*samples, strict=True)
    return tuple(torch.stack([torch.as_tensor(t) for t in part]) for part in (inputs, targets))
