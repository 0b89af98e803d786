"""MNIST-style data: find (or download) the four IDX files, hold each split in memory, batch it.

Three splits: `train` and `val` (`data.val_size` images held out of the training files by a draw
that depends on `data.split_seed` alone), and `test` (the test files), evaluated once at the end.

`loader=tensor` (the default): each split lives once as a uint8 tensor on the training device; a
batch is gathered by index and normalised there, so the loop runs no per-sample Python.
`loader=torch`: the standard `DataLoader` over a per-sample `Dataset`, the path to extend with
per-sample transforms, augmentation or data that does not fit in memory.

Both draw the same sample order: the permutation `DistributedSampler` draws, cut into global
batches that are split over the ranks (`GlobalBatchSampler`), so it depends on `seed` and the
epoch only, never on `parallel=` or the loader.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from src import storage
from src.distributed import Process
from src.errors import UserError

log = logging.getLogger(__name__)

# The four files of an MNIST-style dataset (each may also be gzipped, with a .gz suffix).
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IMAGE_SHAPE = (28, 28)


def read_idx(path: Path) -> torch.Tensor:
    """Read one IDX file of unsigned bytes, gzipped or not, checking its header and its length."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as err:
        raise UserError(
            f"Could not read {path}: it is truncated or not a valid gzip file ({err}). "
            "Replace it with a good copy, or delete it to download it again."
        ) from None
    # Header: two zero bytes, the element type (0x08 = unsigned byte), the number of dimensions,
    # then each dimension as a big-endian uint32.
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08" or raw[3] not in (1, 3):
        raise UserError(
            f"{path} is not an IDX file of images or labels "
            f"(magic number {raw[:4].hex() or 'missing'}). Replace it with the original file."
        )
    header = 4 + 4 * raw[3]
    shape = struct.unpack(f">{raw[3]}I", raw[4:header]) if len(raw) >= header else (0,)
    if len(raw) != header + math.prod(shape):
        raise UserError(
            f"{path} is truncated or corrupt: its header announces shape {shape}, which needs "
            f"{header + math.prod(shape)} bytes, but it holds {len(raw)}. "
            "Replace it with a good copy."
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=header).view(shape)


def find_file(folder: Path, name: str) -> Path | None:
    """`folder/name` or `folder/name.gz`, whichever exists (the uncompressed one first)."""
    return next((p for p in (folder / name, folder / f"{name}.gz") if p.is_file()), None)


def find_idx_folder(root: Path, torchvision_class: str) -> Path | None:
    """The folder holding all four files: `root` itself, or torchvision's `root/<Class>/raw`."""
    for folder in (root, root / torchvision_class / "raw"):
        if all(find_file(folder, name) for names in FILES.values() for name in names):
            return folder
    return None


def download_with_torchvision(root: Path, torchvision_class: str) -> None:
    """Download the four files with torchvision into `root/<Class>/raw`: into a folder beside
    it first, so that a download that fails (a full disk, a lost connection) leaves no partial
    file for the next run to read."""
    import torchvision  # slow to import, and only needed here

    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{torchvision_class}."))  # one per process
    try:
        getattr(torchvision.datasets, torchvision_class)(str(staging), train=True, download=True)
        target = root / torchvision_class / "raw"
        target.mkdir(parents=True, exist_ok=True)
        for file in (staging / torchvision_class / "raw").iterdir():
            os.replace(file, target / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def unwritable(folder: Path) -> str | None:
    """Why files cannot be written into `folder` (made if missing), or None if they can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as err:
        return err.strerror or str(err)


def download_failed(err: Exception, root: Path) -> str:
    """Why a download failed, in a few words; a full disk stops the run with its own message."""
    if isinstance(err, OSError) and err.errno in storage.FULL:
        reason, fix = storage.FULL[err.errno]
        raise UserError(
            f"The download into {root} stopped: {reason} ({err.strerror}). The partial "
            f"download is removed. {fix}, or set data.root to a folder with room: the dataset "
            "takes about 70 MB."
        ) from None
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [repr(err)]
    return f"the download failed ({' '.join(dict.fromkeys([lines[0], lines[-1]]))})"


class GlobalBatchSampler:
    """This rank's share of each global batch, in the order `DistributedSampler` draws.

    Every rank draws the same permutation (DistributedSampler's, seeded by `seed + epoch`), cuts it
    into global batches of `batch_size` and takes every `world_size`-th sample of each batch,
    starting at its rank. When the counts divide, that is exactly DistributedSampler's strided
    split. Unlike DistributedSampler, the last, partial batch is split as it is instead of being
    padded with repeated samples, so an epoch is the same for every world size.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Epoch `epoch`'s order, leaving out its first `skip` batches (done before a resume)."""
        self.epoch, self.skip = epoch, skip

    def permutation(self) -> torch.Tensor:
        """The epoch's order of all samples: the draw of DistributedSampler(shuffle=True)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def index_batches(self, device: torch.device | None = None) -> Iterator[torch.Tensor]:
        """This rank's shares as index tensors on `device`, cut from one permutation tensor."""
        order = self.permutation().to(device)
        size = self.batch_size
        for start in range(self.skip * size, self.num_samples, size):
            yield order[start : start + size][self.rank :: self.world_size]

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for index in self.index_batches():
            yield index.tolist()


def hold_out(count: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of `count` images split in two: the rest, and `size` held out, each in file order.

    The draw depends on `seed` alone, so every run that sets it validates on the same images,
    whatever its `seed`, number of processes, loader, `data.subset` or resume.
    """
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order[size:].sort().values, order[:size].sort().values


class MNISTData:
    """An MNIST-style dataset (MNIST, Fashion-MNIST, ...) in memory, batched for this process.

    `batch_size` is the global batch of one optimizer step; under ddp each rank gets its
    `batch_size / world_size` share. Evaluation gives each rank every `world_size`-th image of the
    split, so every image is counted exactly once whatever the world size.
    """

    def __init__(
        self,
        root: str,
        torchvision_class: str,
        download: bool,
        mean: float,
        std: float,
        num_classes: int,
        batch_size: int,
        test_batch_size: int,
        subset: int | None,
        seed: int,
        val_size: int,
        split_seed: int,
        loader: str = "tensor",
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        class_names: list[str] | None = None,
    ):
        if loader not in ("tensor", "torch"):
            raise UserError(f"data.loader={loader} is not a loader: use tensor or torch.")
        self.root = Path(root)
        self.loader = loader
        self.workers = {"num_workers": num_workers, "pin_memory": pin_memory,
                        "persistent_workers": persistent_workers and num_workers > 0}  # fmt: skip
        self.torchvision_class = torchvision_class
        self.download = download
        self.mean, self.std = mean, std
        self.normalise = Normalise(mean, std)
        self.num_classes = num_classes
        self.class_names = list(class_names) if class_names else None
        self.batch_size = batch_size
        self.test_batch_size = test_batch_size
        self.subset = subset
        self.seed = seed
        self.val_size, self.split_seed = val_size, split_seed

    def setup(self, process: Process) -> None:
        """Check the batch size, find or download the files, load both splits onto the device."""
        if self.batch_size < 1 or self.batch_size % process.world_size:
            raise UserError(
                f"data.batch_size={self.batch_size} does not divide over {process.world_size} "
                f"processes. Use a multiple of {process.world_size}: it is the global batch, "
                "and each rank takes an equal share."
            )
        # One process per machine looks for the files and downloads them if needed while the
        # others wait; gathering its verdict is the barrier, and every rank stops on an error.
        error = None
        if process.is_local_main:
            try:
                self._locate_or_download()
            except UserError as err:
                error = str(err)
        errors = [e for e in process.all_gather_object(error) if e]
        if errors:
            raise UserError(errors[0])

        # loader=torch keeps the images in RAM and copies each batch to the device.
        folder = find_idx_folder(self.root, self.torchvision_class)
        home = process.device if self.loader == "tensor" else torch.device("cpu")
        files = self._load(folder, "train", home)
        if self.val_size >= len(files[1]):
            raise UserError(
                f"data.val_size={self.val_size} leaves no training images: the training files "
                f"in {folder} hold {len(files[1])}. Hold out fewer (0 for none)."
            )
        # Positions in the training files; `subset` takes the first training images among them.
        self.train_index, self.val_index = hold_out(len(files[1]), self.val_size, self.split_seed)
        self.train_index = self.train_index[: self.subset]
        self.train, self.val = (
            tuple(t.index_select(0, index.to(t.device)) for t in files)
            for index in (self.train_index, self.val_index)
        )
        self.test = self._load(folder, "test", home)
        self.device = process.device
        self.rank, self.world_size = process.rank, process.world_size
        self.sampler = GlobalBatchSampler(
            len(self.train[1]), self.batch_size, process.rank, process.world_size, self.seed
        )
        if self.loader == "torch":
            dataset = IDXDataset(*self.train, standard_transform(self.mean, self.std))
            self.train_loader = DataLoader(
                dataset, batch_sampler=self.sampler, collate_fn=collate, **self.workers
            )
        log.info(
            "Data: %d training, %d validation (data.val_size) and %d test images from %s",
            len(self.train[1]),
            len(self.val[1]),
            len(self.test[1]),
            folder,
        )

    def _locate_or_download(self) -> None:
        if find_idx_folder(self.root, self.torchvision_class):
            return
        where = f"{self.root} or {self.root / self.torchvision_class / 'raw'}"
        reason = "data.download=false"
        if self.download and (why := unwritable(self.root)):
            raise UserError(
                f"{self.torchvision_class} IDX files not found in {where}, and data.root="
                f"{self.root} cannot be written to download them into ({why}). Set data.root to "
                "a writable folder, or put the four files in it."
            )
        if self.download:
            log.info(
                "%s not found in %s: downloading it with torchvision", self.torchvision_class, where
            )
            try:
                download_with_torchvision(self.root, self.torchvision_class)
            except Exception as err:  # noqa: BLE001 - any network failure means the same to the user
                reason = download_failed(err, self.root)
            if find_idx_folder(self.root, self.torchvision_class):
                return
        raise UserError(
            f"{self.torchvision_class} IDX files not found in {where}, and {reason}. "
            "Put the four files (train/t10k images and labels, gzipped or not) there, point "
            "data.root at a folder that holds them, or train on Fashion-MNIST offline: "
            "apt-get install dataset-fashion-mnist, then "
            "data=fashion_mnist data.root=/usr/share/datasets/fashion-mnist"
        )

    def _load(
        self, folder: Path, split: str, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        image_path, label_path = (find_file(folder, name) for name in FILES[split])
        images, labels = read_idx(image_path), read_idx(label_path)
        if images.dim() != 3 or tuple(images.shape[1:]) != IMAGE_SHAPE:
            raise UserError(
                f"{image_path} holds images of shape {tuple(images.shape)}, not N×28×28."
            )
        if labels.dim() != 1 or len(labels) != len(images):
            raise UserError(
                f"{label_path} holds {tuple(labels.shape)} labels for {len(images)} images in "
                f"{image_path}: the two files do not belong together."
            )
        if len(labels) and labels.max() >= self.num_classes:
            raise UserError(
                f"{label_path} has label {labels.max().item()}, "
                f"but data.num_classes={self.num_classes}."
            )
        # Channel dimension first, as the models expect: N×1×28×28.
        return images.unsqueeze(1).to(device), labels.long().to(device)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.sampler)

    def train_batches(
        self, epoch: int, skip: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """This rank's (images, labels) of each global batch, with the global batch's size.

        `skip` leaves out the epoch's first batches, which a resumed run has already trained on.
        """
        self.sampler.set_epoch(epoch, skip)
        num_samples = len(self.train[1])
        for step, (images, labels) in enumerate(self._batches(), start=skip):
            global_size = min(self.batch_size, num_samples - step * self.batch_size)
            yield images, labels, global_size

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.loader == "torch":
            for images, labels in self.train_loader:  # pinned memory makes these copies async
                yield (images.to(self.device, non_blocking=True),
                       labels.to(self.device, non_blocking=True))  # fmt: skip
        else:
            for index in self.sampler.index_batches(self.device):  # no per-sample Python
                # index_select: the same rows as images[index], several times faster on a CPU.
                images, labels = (t.index_select(0, index) for t in self.train)
                yield self.normalise(images), labels

    def eval_batches(self, split: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's images of `split` (val or test): every world_size-th one, in batches of
        test_batch_size."""
        images, labels = getattr(self, split)
        index = torch.arange(self.rank, len(labels), self.world_size, device=labels.device)
        for chunk in index.split(self.test_batch_size) if len(index) else ():
            batch = images.index_select(0, chunk), labels.index_select(0, chunk)
            yield self.normalise(batch[0].to(self.device)), batch[1].to(self.device)


class Normalise:
    """uint8 → float, scaled like torchvision's ToTensor() then Normalize(mean, std)."""

    def __init__(self, mean: float, std: float):
        self.mean, self.std = mean, std

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return images.float().div_(255).sub_(self.mean).div_(self.std)


def standard_transform(mean: float, std: float) -> Callable[[Image.Image], torch.Tensor]:
    """torchvision's MNIST pipeline: PIL image → ToTensor() → Normalize(mean, std). Add
    per-sample augmentation here (transforms.RandomRotation(10), ...)."""
    from torchvision import transforms  # slow to import: only for loader=torch

    return transforms.Compose([transforms.ToTensor(), transforms.Normalize((mean,), (std,))])


class IDXDataset(Dataset):
    """One sample at a time, as torchvision's MNIST dataset gives them: a PIL image, transformed,
    and its label. The `loader=torch` path."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = Image.fromarray(self.images[index, 0].numpy(), mode="L")
        return self.transform(image), self.labels[index]


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples into a batch; a rank's share of a last, small batch may be empty."""
    if not samples:
        return torch.empty(0, 1, *IMAGE_SHAPE), torch.empty(0, dtype=torch.long)
    images, labels = zip(*samples, strict=True)
    return torch.stack(images), torch.stack(labels)
