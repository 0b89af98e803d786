"""Where the data come from (`dataset:` in `conf/data/`): `prepare()` finds or downloads a dataset's
files once per machine; `split(name)` reads a split as a `Dataset` of (input, target) (torch's
`TensorDataset` is taken whole), sets `classes`; `cache_path` and `fingerprint` cache the
decoding."""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import importlib
import inspect
import logging
import math
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from tempfile import TemporaryDirectory, TemporaryFile
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset, TensorDataset

from src.engine import storage
from src.engine.errors import UserError, first_line

log = logging.getLogger(__name__)


def torchvision_dataset(name: str) -> type:
    """A class of torchvision.datasets by name (CIFAR10), or any class by its dotted path."""
    module, _, attribute = name.rpartition(".")
    try:  # torchvision.datasets, slow to import, only where needed
        return getattr(importlib.import_module(module or "torchvision.datasets"), attribute)
    except (ImportError, AttributeError) as err:
        raise UserError(
            f"data.torchvision_class={name} is no class that can be imported ({first_line(err)}): "
            "name one of torchvision.datasets (SVHN, ...) or a dotted path (my_package.MyDataset)."
        ) from None


class Torchvision:
    """Any torchvision dataset of (PIL image, label) (KMNIST, SVHN…), converted as ImageFolder's. A
    subclass of images of one shape (CIFAR10, IDX) sets `channels` and `size`: data.image_size and
    data.in_channels may only agree."""

    what, download_size = "files", None  # for the messages (a full disk names the size)
    # A subclass of one image shape's: its default torchvision class, channels, size, and name.
    default_class, channels, size, name = "", None, None, None

    def __init__(
        self,
        root: str,
        torchvision_class: str | None = None,
        download: bool = True,
        split_argument: str = "train",
        image_size: int | None = None,
        in_channels: int | None = None,
    ):
        torchvision_class = torchvision_class or self.default_class
        fixed = {"image_size": (image_size, self.size), "in_channels": (in_channels, self.channels)}
        for key, (asked, has) in fixed.items():
            if has and asked not in (None, has):
                raise UserError(
                    f"data.{key}={asked}, but {self.name or torchvision_class} images have {has}. "
                    f"Leave it at {has}: only data=image_folder resizes and converts images."
                )
        if split_argument not in ("train", "split"):
            raise UserError(f"data.split_argument={split_argument}: use train or split.")
        self.root, self.torchvision_class, self.download = Path(root), torchvision_class, download
        self.split_argument, self.image_size = split_argument, image_size
        self.in_channels, self.classes = self.channels or in_channels or 3, None

    def _open(
        self, name: str, root: Path | None = None, download: bool = False, **keys: Any
    ) -> Dataset:
        asked = {"train": name == "train"} if self.split_argument == "train" else {"split": name}
        # download passed always: a class of a fork's may download by default, into root itself
        dataset = torchvision_dataset(self.torchvision_class)
        return dataset(str(root or self.root), download=download, **asked, **keys)

    def found(self) -> bool:
        try:
            self._open("train"), self._open("test")
        except (RuntimeError, OSError):  # torchvision: "Dataset not found or corrupted", …
            return False
        return True

    def prepare(self) -> None:
        if not self.found():
            reason = self._download() if self.download else "data.download=false"
            if not self.found():
                raise self.missing(reason)

    def _download(self) -> str:
        """Download into a folder beside `root`'s files, then move them in; say why none came."""
        name, root, size = self.torchvision_class, self.root, self.download_size
        try:  # can files be written there (the folder made if missing)?
            root.mkdir(exist_ok=True)  # in a folder that exists: a mistyped path makes none
            TemporaryFile(dir=root).close()
        except OSError as err:
            raise UserError(
                f"{name} {self.what} not found in {root}, and data.root={root} cannot be written "
                f"to download them into ({err.strerror or err}). Set data.root to a writable "
                f"folder, or put the {self.what} in it."
            ) from None
        log.info("%s not found in %s: downloading it with torchvision", name, root)
        try:  # one staging folder per process: a failed download leaves no partial file
            staging = TemporaryDirectory(dir=root, prefix=f".{name}.", ignore_cleanup_errors=True)
            with staging as folder:
                for split in ("train", "test"):
                    self._open(split, Path(folder), download=True)
                for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
                    target = root / file.relative_to(folder)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(file, target)
        except Exception as err:  # noqa: BLE001 - any network failure means the same to the user
            if isinstance(err, OSError) and err.errno in storage.FULL:  # a full disk stops the run
                reason, fix = storage.FULL[err.errno]
                takes = f": the dataset takes about {size}" if size else ""
                raise UserError(
                    f"The download into {root} stopped: {reason} ({err.strerror}). The partial "
                    f"download is removed. {fix}, or set data.root to a folder with room{takes}."
                ) from None
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [repr(err)]
            return f"the download failed ({' '.join(dict.fromkeys([lines[0], lines[-1]]))})"
        return "the download did not bring them"

    def missing(self, reason: str) -> UserError:
        return UserError(
            f"torchvision's {self.torchvision_class} not found in {self.root}, and {reason}. Point "
            "data.root at its files (as torchvision lays them out), or download them there online."
        )

    def split(self, name: str) -> Dataset:
        """The split, its images converted and resized by `to_uint8` (torchvision's `transform`)."""
        convert = functools.partial(
            to_uint8, in_channels=self.in_channels, image_size=self.image_size
        )
        dataset = self._open(name, transform=convert, target_transform=int)
        self.classes = list(dataset.classes) if hasattr(dataset, "classes") else None
        return dataset

    def cache_path(self, name: str) -> Path:
        size = self.image_size or "orig"
        return self.root / f".{self.torchvision_class}-{name}-{self.in_channels}x{size}.cache.pt"

    def fingerprint(self, dataset: Dataset) -> str:
        """What the decoded images depend on (torchvision checks its own files)."""
        return decoding(self.in_channels, self.image_size, len(dataset)).hexdigest()

    def __str__(self) -> str:
        return f"{self.torchvision_class} in {self.root}"


class CIFAR10(Torchvision):
    """CIFAR-10 (60,000 32×32 images, 10 classes) in `root/cifar-10-batches-py`, checksummed."""

    default_class, channels, size, name, download_size = "CIFAR10", 3, 32, "CIFAR-10", "170 MB"

    def missing(self, reason: str) -> UserError:
        return UserError(
            f"CIFAR-10 not found in {self} (or its files do not match torchvision's checksums), "
            f"and {reason}. Point data.root at cifar-10-batches-py's folder, or download it online."
        )

    def split(self, name: str) -> TensorDataset:
        dataset = self._open(name)
        self.classes = list(dataset.classes)
        images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # N×3×32×32
        return TensorDataset(images, torch.tensor(dataset.targets, dtype=torch.long))

    def __str__(self) -> str:
        return str(self.root / "cifar-10-batches-py")


class IDX(Torchvision):
    """Four MNIST-style IDX files (28×28 grey, numbered classes) in `root` or `root/<Class>/raw`."""

    default_class, channels, size, what, download_size = "MNIST", 1, 28, "IDX files", "70 MB"

    def found(self) -> bool:
        return find_idx_folder(self.root, self.torchvision_class) is not None

    def missing(self, reason: str) -> UserError:
        for folder in (self.root, self.root / self.torchvision_class / "raw"):
            lacking = [name for name, path in idx_files(folder).items() if path is None]
            if 0 < len(lacking) < 4:  # some of the four are there: name the others
                return UserError(
                    f"{folder} lacks {', '.join(lacking)} (gzipped or not) of the four "
                    f"{self.torchvision_class} IDX files, and {reason}. Put the missing "
                    "files beside the others."
                )
        return UserError(
            f"{self.torchvision_class} IDX files not found in {self.root} or "
            f"{self.root / self.torchvision_class / 'raw'}, and {reason}. Put the four files "
            "(train/t10k images and labels, gzipped or not) there, point data.root at a folder that"
            " holds them, or train on Fashion-MNIST offline: apt-get install dataset-fashion-mnist,"
            " then data=fashion_mnist data.root=/usr/share/datasets/fashion-mnist"
        )

    def split(self, name: str) -> TensorDataset:
        folder = find_idx_folder(self.root, self.torchvision_class)
        image_path, label_path = map(idx_files(folder).get, IDX_FILES[name])
        images, labels = read_idx(image_path), read_idx(label_path)
        if images.shape[1:] != (28, 28):
            raise UserError(f"{image_path} holds images {tuple(images.shape)}, not N×28×28.")
        if labels.shape != images.shape[:1]:
            raise UserError(
                f"{label_path} holds {tuple(labels.shape)} labels for {len(images)} images in "
                f"{image_path}: the two files do not belong together."
            )
        known = KNOWN_IDX.get(hashlib.sha256(labels.numpy().tobytes()).hexdigest()[:16])
        asked = self.torchvision_class.rsplit(".", 1)[-1]  # torchvision.datasets.MNIST: MNIST
        if known and known[0] != asked:  # it would train, on the wrong statistics
            raise UserError(
                f"{folder} holds {known[0]}'s IDX files, not {asked}'s ({label_path.name} is "
                f"{known[0]}'s). Train on them with data={known[1]} data.root={folder}, or point "
                f"data.root at {asked}'s files."
            )
        return TensorDataset(images.unsqueeze(1), labels.long())  # N×1×28×28: channels first

    def __str__(self) -> str:
        return str(find_idx_folder(self.root, self.torchvision_class))


# The IDX datasets known by their labels (SHA-256 of each split's label bytes, gzipped or not, as
# read from the published files): (torchvision's class, its data= config). The four files of one
# look like any other's, so given as another (data=mnist on Fashion-MNIST's) they would train.
KNOWN_IDX = {
    "1feba77c54802fa5": ("MNIST", "mnist"),  # train-labels-idx1-ubyte
    "ddeff807876a9661": ("MNIST", "mnist"),  # t10k-labels-idx1-ubyte
    "657fbd221bfc9f41": ("FashionMNIST", "fashion_mnist"),
    "3d0e6c6ea990b53b": ("FashionMNIST", "fashion_mnist"),
}


IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path) -> torch.Tensor:
    """Read one IDX file of unsigned bytes, gzipped or not, checking its header and its length."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:
        raise UserError(
            f"Could not read {path}: it is truncated or not a valid gzip file ({err}). "
            "Replace it with a good copy, or delete it to download it again."
        ) from None
    # Header: 0, 0, 0x08 (unsigned bytes), the number of dimensions, each as a big-endian uint32.
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
            f"{header + math.prod(shape)} bytes; it holds {len(raw)}. Replace it with a good copy."
        )
    if not math.prod(shape):
        raise UserError(
            f"{path} holds no {'labels' if raw[3] == 1 else 'images'} (its header announces "
            f"shape {shape}): a split cannot be empty. Replace it with the original file."
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=header).view(shape)


def idx_files(folder: Path) -> dict[str, Path | None]:
    """The four IDX files by name, each `folder/name` or `folder/name.gz` (the uncompressed one
    first), None where `folder` holds neither."""
    names = [name for pair in IDX_FILES.values() for name in pair]
    return {
        n: next((p for p in (folder / n, folder / f"{n}.gz") if p.is_file()), None) for n in names
    }


def find_idx_folder(root: Path, torchvision_class: str) -> Path | None:
    """The folder holding all four files: `root` itself, or torchvision's `root/<Class>/raw`."""
    folders = (root, root / torchvision_class / "raw")
    return next((f for f in folders if all(idx_files(f).values())), None)


class ImageFolder:
    """Images (any format PIL reads) in `root/train/<class>/` and `root/test/<class>/`."""

    def __init__(self, root: str, image_size: int | None = None, in_channels: int = 3):
        if in_channels not in (1, 3):
            raise UserError(f"data.in_channels={in_channels}: use 1 (grey) or 3 (RGB).")
        self.root, self.image_size, self.in_channels = Path(root), image_size, in_channels
        self.classes: list[str] | None = None

    def prepare(self) -> None:
        """Check the folders, the classes and the images' headers (sizes) before any is decoded."""
        train, test = self.split("train"), self.split("test")
        if train.classes != test.classes:
            raise UserError(
                f"{self.root / 'test'} has the classes {test.classes} but {self.root / 'train'} "
                f"has {train.classes}: both need the same class folders, one per label."
            )
        sizes: dict[tuple[int, int], str] = {}
        for path, _ in train.samples + test.samples:
            with opened(path) as image:
                sizes.setdefault(image.size, path)
        if self.image_size is None and len(sizes) > 1:
            (size, first), (other, second), *_ = sizes.items()
            raise UserError(
                f"{first} is {size[0]}×{size[1]} but {second} is {other[0]}×{other[1]}: set "
                "data.image_size (e.g. 64) to resize and centre-crop them all to one square size."
            )
        (width, height), *_ = sizes
        if self.image_size is None and width != height:
            raise UserError(
                f"The images are {width}×{height}, not square: set data.image_size "
                f"(e.g. {min(width, height)}) to resize and centre-crop them."
            )

    def split(self, name: str) -> Dataset:
        from torchvision.datasets import ImageFolder as Folder

        folder = self.root / name
        if not folder.is_dir():
            raise UserError(
                f"{folder} is not a folder. data=image_folder reads {self.root}/train/<class>/… "
                f"and {self.root}/test/<class>/…: one folder per class, holding its images."
            )
        try:
            dataset = Folder(str(folder), loader=self.load)
        except FileNotFoundError as err:  # no class folder, or one without images
            raise UserError(
                f"{folder}: {err}".rstrip(". ") + ". Every class folder needs at least one "
                "image; remove empty ones."
            ) from None
        self.classes = dataset.classes
        return dataset

    def load(self, path: str) -> torch.Tensor:
        with opened(path) as image:
            image.load()
            return to_uint8(image, self.in_channels, self.image_size)

    def fingerprint(self, dataset: Dataset) -> str:
        """Changes when a file of the split changes, or the decoding (`load`, `to_uint8`)."""
        digest = decoding(self.in_channels, self.image_size, inspect.getsource(type(self).load))
        for path, label in dataset.samples:
            stat = os.stat(path)
            digest.update(f"{path} {label} {stat.st_size} {stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()

    def cache_path(self, name: str) -> Path:
        return self.root / f".{name}-{self.in_channels}x{self.image_size or 'orig'}.cache.pt"

    def __str__(self) -> str:
        return str(self.root)


@contextlib.contextmanager
def opened(path: str) -> Iterator[Image.Image]:
    """The image file opened by Pillow; one it cannot decode (or a decompression bomb) named."""
    try:
        with Image.open(path) as image:
            yield image
    except Image.DecompressionBombError as err:
        raise UserError(
            f"{path} is too large to open: {first_line(err)} Replace it with a smaller copy, or "
            "delete it."
        ) from None
    except (OSError, UnidentifiedImageError, SyntaxError) as err:
        raise UserError(
            f"{path} could not be read as an image ({err}). Replace or delete it."
        ) from None


def to_uint8(image: Image.Image, in_channels: int, image_size: int | None) -> torch.Tensor:
    """A PIL image as uint8 C×H×W, converted and resized as asked; your own transforms go here."""
    from torchvision.transforms import functional

    if image.mode.startswith("I;16") or image.mode == "I":  # convert() would clip 16 bits (white)
        pixels = np.asarray(image, dtype=np.int64).clip(0, 65535) >> 8
        image = Image.fromarray(pixels.astype(np.uint8), mode="L")
    image = image.convert("L" if in_channels == 1 else "RGB")
    if image_size:
        image = functional.center_crop(functional.resize(image, image_size), image_size)
    return functional.pil_to_tensor(image)


def decoding(*settings: object) -> hashlib._Hash:
    """A digest of how images are decoded (`settings`, `to_uint8`, Pillow and torchvision)."""
    import PIL
    import torchvision

    versions = [PIL.__version__, torchvision.__version__]
    return hashlib.sha256(f"{list(settings)} {versions} {inspect.getsource(to_uint8)}".encode())
