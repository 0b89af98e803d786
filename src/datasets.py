"""Where the data come from: find (or download) a dataset's files and read each split as a
map-style `Dataset` of (input, target) pairs. The classes here read images, an image being a
uint8 tensor C×H×W and its target an int label; a class of your own may give inputs and targets
of any shape and dtype (float features, int64 tokens), which `src/engine/data.py` batches as
they are.

One class per kind of files, named by `dataset:` in its `conf/data/` file:

- `IDX`: MNIST-style files (MNIST, Fashion-MNIST), downloaded with torchvision when missing;
- `CIFAR10`: torchvision's `CIFAR10` class and files, downloaded when missing;
- `Torchvision`: any other torchvision dataset of (PIL image, label) samples (SVHN, KMNIST, …);
- `ImageFolder`: your own images, one folder per class (`train/<class>/…`, `test/<class>/…`).

Each has `prepare()` (find or download the files: one process per machine runs it while the
others wait), `split(name)` (the `train` or `test` Dataset; one with `tensors()`, as `Tensors`,
is handed over whole) and `classes` (the label names, or None, known after `split`). Its
constructor gets the keys of its `conf/data/` file that `src/engine/data.py` does not take, and
each of `src/engine/data.py`'s own (image_size, num_classes, seed, …) it has a parameter of that
name for.
`src/engine/data.py` holds the splits in memory and batches them, the same way for all. A class
whose samples must be decoded one by one may keep them decoded in a cache file: it then has
`cache_path(split)` and `fingerprint(dataset)`, as `ImageFolder` has.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib
import inspect
import logging
import math
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from src.engine import storage
from src.engine.errors import UserError, first_line

log = logging.getLogger(__name__)

Fetch = Callable[[Path], object]  # downloads a dataset into the folder it is given


class Tensors(Dataset):
    """A split already in memory: inputs N×… (uint8 images N×C×H×W, float features, tokens) and
    their targets N×…. `tensors()` hands it over whole, so the fast path does not read it one
    sample at a time."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs, self.targets


def check_shape(
    name: str, image_size: int | None, in_channels: int | None, size: int, channels: int
) -> None:
    """Refuse a data.image_size or data.in_channels that a dataset of fixed-size images lacks."""
    for key, asked, has in (
        ("image_size", image_size, size),
        ("in_channels", in_channels, channels),
    ):
        if asked not in (None, has):
            raise UserError(
                f"data.{key}={asked}, but {name} images have {has}. Leave it at {has}: only "
                "data=image_folder resizes and converts images."
            )


# ---------------------------------------------------------------------------------------------
# MNIST-style IDX files

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


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
    if not math.prod(shape):
        raise UserError(
            f"{path} holds no {'labels' if raw[3] == 1 else 'images'} (its header announces "
            f"shape {shape}): a split cannot be empty. Replace it with a file that holds its "
            "split, such as the original."
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=header).view(shape)


def find_file(folder: Path, name: str) -> Path | None:
    """`folder/name` or `folder/name.gz`, whichever exists (the uncompressed one first)."""
    return next((p for p in (folder / name, folder / f"{name}.gz") if p.is_file()), None)


def find_idx_folder(root: Path, torchvision_class: str) -> Path | None:
    """The folder holding all four files: `root` itself, or torchvision's `root/<Class>/raw`."""
    for folder in (root, root / torchvision_class / "raw"):
        if all(find_file(folder, name) for names in IDX_FILES.values() for name in names):
            return folder
    return None


class IDX:
    """An MNIST-style dataset (MNIST, Fashion-MNIST, ...): four IDX files of 28×28 grey images
    and labels, in `root` or torchvision's `root/<Class>/raw`."""

    def __init__(
        self,
        root: str,
        download: bool = True,
        torchvision_class: str = "MNIST",
        image_size: int | None = None,
        in_channels: int | None = None,
    ):
        check_shape(torchvision_class, image_size, in_channels, 28, 1)
        self.root, self.download, self.torchvision_class = Path(root), download, torchvision_class
        self.classes = None  # the label numbers

    def prepare(self) -> None:
        if find_idx_folder(self.root, self.torchvision_class):
            return
        where = f"{self.root} or {self.root / self.torchvision_class / 'raw'}"
        reason = "data.download=false"
        if self.download:
            reason = download(self.root, self.torchvision_class, "IDX files", "70 MB")
            if find_idx_folder(self.root, self.torchvision_class):
                return
        raise UserError(
            f"{self.torchvision_class} IDX files not found in {where}, and {reason}. "
            "Put the four files (train/t10k images and labels, gzipped or not) there, point "
            "data.root at a folder that holds them, or train on Fashion-MNIST offline: "
            "apt-get install dataset-fashion-mnist, then "
            "data=fashion_mnist data.root=/usr/share/datasets/fashion-mnist"
        )

    def split(self, name: str) -> Tensors:
        folder = find_idx_folder(self.root, self.torchvision_class)
        image_path, label_path = (find_file(folder, file) for file in IDX_FILES[name])
        images, labels = read_idx(image_path), read_idx(label_path)
        if images.dim() != 3 or tuple(images.shape[1:]) != (28, 28):
            raise UserError(
                f"{image_path} holds images of shape {tuple(images.shape)}, not N×28×28."
            )
        if labels.dim() != 1 or len(labels) != len(images):
            raise UserError(
                f"{label_path} holds {tuple(labels.shape)} labels for {len(images)} images in "
                f"{image_path}: the two files do not belong together."
            )
        return Tensors(images.unsqueeze(1), labels.long())  # N×1×28×28: channels first

    def __str__(self) -> str:
        return str(find_idx_folder(self.root, self.torchvision_class))


# ---------------------------------------------------------------------------------------------
# CIFAR-10, through torchvision's own class


def torchvision_dataset(name: str) -> type:
    """A class of torchvision.datasets by name (CIFAR10), or any class by its dotted path."""
    try:
        if "." not in name:
            import torchvision  # slow to import, and only needed here

            return getattr(torchvision.datasets, name)
        module, _, attribute = name.rpartition(".")
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise UserError(
            f"data.torchvision_class={name} is no class that can be imported ({first_line(err)}): "
            "name one of torchvision.datasets (SVHN, KMNIST, ...) or give a class's dotted path "
            "(my_package.datasets.MyDataset)."
        ) from None


# ---------------------------------------------------------------------------------------------
# Any other torchvision dataset


class Torchvision:
    """Any torchvision dataset whose samples are (PIL image, label): KMNIST, SVHN, STL10, ….
    `split_argument` says how the class is asked for a split: `train` (train=True/False, as
    MNIST's and CIFAR's) or `split` (split="train"/"test", as SVHN's and STL10's). Images are
    converted and resized as an image folder's (`in_channels`, `image_size`), decoded once."""

    download_size: str | None = None  # for the message when the disk fills during a download

    def __init__(
        self,
        root: str,
        torchvision_class: str,
        download: bool = True,
        split_argument: str = "train",
        image_size: int | None = None,
        in_channels: int = 3,
    ):
        if split_argument not in ("train", "split"):
            raise UserError(f"data.split_argument={split_argument}: use train or split.")
        self.root, self.torchvision_class, self.download = Path(root), torchvision_class, download
        self.split_argument, self.image_size, self.in_channels = (
            split_argument,
            image_size,
            in_channels,
        )
        self.classes: list[str] | None = None

    def _open(self, name: str, root: Path | None = None, download: bool = False) -> Dataset:
        asked = {"train": name == "train"} if self.split_argument == "train" else {"split": name}
        folder = str(root or self.root)
        return torchvision_dataset(self.torchvision_class)(folder, download=download, **asked)

    def prepare(self) -> None:
        try:
            self._open("train"), self._open("test")
            return
        except (RuntimeError, OSError):  # torchvision: "Dataset not found or corrupted", …
            reason = "data.download=false"
        if self.download:
            fetch = lambda folder: [self._open(n, folder, True) for n in ("train", "test")]  # noqa: E731
            reason = download(self.root, self.torchvision_class, "files", self.download_size, fetch)
            try:
                self._open("train"), self._open("test")
                return
            except (RuntimeError, OSError):
                pass
        raise self.missing(reason)

    def missing(self, reason: str) -> UserError:
        """What to do when the files are neither found nor downloaded, and why (`reason`)."""
        return UserError(
            f"torchvision's {self.torchvision_class} not found in {self.root}, and {reason}. "
            "Point data.root at the folder that holds its files as torchvision lays them out, "
            "or download them there on a machine with internet."
        )

    def split(self, name: str) -> Dataset:
        dataset = self._open(name)
        self.classes = list(dataset.classes) if hasattr(dataset, "classes") else None
        return Converted(dataset, functools.partial(to_uint8, in_channels=self.in_channels,
                                                    image_size=self.image_size))  # fmt: skip

    def cache_path(self, name: str) -> Path:
        size = self.image_size or "orig"
        return self.root / f".{self.torchvision_class}-{name}-{self.in_channels}x{size}.cache.pt"

    def fingerprint(self, dataset: Dataset) -> str:
        """What the decoded images depend on: the decoding, and the split's size (torchvision
        checks its own files)."""
        return decoding(self.in_channels, self.image_size, len(dataset)).hexdigest()

    def __str__(self) -> str:
        return f"{self.torchvision_class} in {self.root}"


class CIFAR10(Torchvision):
    """CIFAR-10: 50,000 training and 10,000 test images, 32×32 colour, 10 classes, read with
    torchvision's class (which checks the files' checksums) from `root/cifar-10-batches-py`.
    Its images come as one array, handed over whole rather than one PIL image at a time."""

    download_size = "170 MB"

    def __init__(
        self,
        root: str,
        download: bool = True,
        torchvision_class: str = "CIFAR10",
        image_size: int | None = None,
        in_channels: int | None = None,
    ):
        check_shape("CIFAR-10", image_size, in_channels, 32, 3)
        super().__init__(root, torchvision_class, download, in_channels=3)

    def missing(self, reason: str) -> UserError:
        return UserError(
            f"CIFAR-10 not found in {self} (or its files do not match torchvision's checksums), "
            f"and {reason}. Point data.root at the folder that holds cifar-10-batches-py, or "
            "download it there on a machine with internet."
        )

    def split(self, name: str) -> Tensors:
        dataset = self._open(name)
        self.classes = list(dataset.classes)
        images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()  # N×3×32×32
        return Tensors(images, torch.tensor(dataset.targets, dtype=torch.long))

    def __str__(self) -> str:
        return str(self.root / "cifar-10-batches-py")


class Converted(Dataset):
    """A dataset of (PIL image, label), its images turned into uint8 tensors by `convert`."""

    def __init__(self, dataset: Dataset, convert: Callable[[Image.Image], torch.Tensor]):
        self.dataset, self.convert = dataset, convert

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.dataset[index]
        return self.convert(image), int(label)


# ---------------------------------------------------------------------------------------------
# Downloads


def download(
    root: Path, torchvision_class: str, what: str, size: str | None, fetch: Fetch | None = None
) -> str:
    """Download with torchvision into `root` (`fetch(folder)` downloads into `folder`; by default
    the class's training split); return why it did not bring the files, in a few words."""
    if why := unwritable(root):
        raise UserError(
            f"{torchvision_class} {what} not found in {root}, and data.root={root} cannot be "
            f"written to download them into ({why}). Set data.root to a writable folder, or put "
            f"the {what} in it."
        )
    log.info("%s not found in %s: downloading it with torchvision", torchvision_class, root)
    try:
        download_with_torchvision(root, torchvision_class, fetch)
    except Exception as err:  # noqa: BLE001 - any network failure means the same to the user
        return download_failed(err, root, size)
    return "the download did not bring them"


def download_with_torchvision(
    root: Path, torchvision_class: str, fetch: Fetch | None = None
) -> None:
    """Download with torchvision's class into a folder beside `root`'s files first, then move
    what it wrote in: a download that fails (a full disk, a lost connection) leaves no partial
    file for the next run to read."""
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{torchvision_class}."))  # one per process
    try:
        if fetch:
            fetch(staging)
        else:
            torchvision_dataset(torchvision_class)(str(staging), train=True, download=True)
        for file in sorted(p for p in staging.rglob("*") if p.is_file()):
            target = root / file.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, target)
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


def download_failed(err: Exception, root: Path, size: str | None) -> str:
    """Why a download failed, in a few words; a full disk stops the run with its own message."""
    if isinstance(err, OSError) and err.errno in storage.FULL:
        reason, fix = storage.FULL[err.errno]
        takes = f": the dataset takes about {size}" if size else ""
        raise UserError(
            f"The download into {root} stopped: {reason} ({err.strerror}). The partial "
            f"download is removed. {fix}, or set data.root to a folder with room{takes}."
        ) from None
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [repr(err)]
    return f"the download failed ({' '.join(dict.fromkeys([lines[0], lines[-1]]))})"


# ---------------------------------------------------------------------------------------------
# Your own images: one folder per class


class ImageFolder:
    """Images in torchvision's ImageFolder layout: `root/train/<class>/*.png` and
    `root/test/<class>/*.png` (any format PIL reads), the classes named by their folders.

    Each image is converted to grey (`in_channels=1`) or RGB (3), then, with `image_size`, its
    shorter side resized to `image_size` and its centre cropped square; without `image_size` all
    images must already share one square size.
    """

    def __init__(self, root: str, image_size: int | None = None, in_channels: int = 3):
        if in_channels not in (1, 3):
            raise UserError(f"data.in_channels={in_channels}: use 1 (grey) or 3 (RGB).")
        self.root, self.image_size, self.in_channels = Path(root), image_size, in_channels
        self.classes: list[str] | None = None

    def prepare(self) -> None:
        """Check the layout, the classes, that every file opens as an image and, without
        image_size, that the sizes agree: mistakes found from the file headers, before any
        image is decoded."""
        train, test = (self._samples(name) for name in ("train", "test"))
        if train[0] != test[0]:
            raise UserError(
                f"{self.root / 'test'} has the classes {test[0]} but {self.root / 'train'} has "
                f"{train[0]}: both need the same class folders, one per label."
            )
        sizes: dict[tuple[int, int], str] = {}
        for path, _ in train[1] + test[1]:
            sizes.setdefault(read_header(path), path)
        if self.image_size is not None:
            return
        if len(sizes) > 1:
            (size, first), (other, second), *_ = sizes.items()
            raise UserError(
                f"{first} is {size[0]}×{size[1]} but {second} is {other[0]}×{other[1]}: set "
                "data.image_size (e.g. 64) to resize and centre-crop them all to one square size."
            )
        ((width, height),) = sizes
        if width != height:
            raise UserError(
                f"The images are {width}×{height}, not square: set data.image_size "
                f"(e.g. {min(width, height)}) to resize and centre-crop them."
            )

    def _samples(self, name: str) -> tuple[list[str], list[tuple[str, int]]]:
        from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

        folder = self.root / name
        if not folder.is_dir():
            raise UserError(
                f"{folder} is not a folder. data=image_folder reads {self.root}/train/<class>/… "
                f"and {self.root}/test/<class>/…: one folder per class, holding its images."
            )
        try:
            classes, index = find_classes(str(folder))
            return classes, make_dataset(str(folder), index, IMG_EXTENSIONS)
        except FileNotFoundError as err:  # no class folder, or one without images
            raise UserError(
                f"{folder}: {err}".rstrip(". ") + ". Every class folder needs at least one "
                "image; remove empty ones."
            ) from None

    def split(self, name: str) -> Dataset:
        from torchvision.datasets import ImageFolder as Folder

        dataset = Folder(str(self.root / name), loader=self.load)
        self.classes = dataset.classes
        return dataset

    def load(self, path: str) -> torch.Tensor:
        """One image file as a uint8 tensor C×H×W, converted and resized as configured."""
        try:
            with Image.open(path) as image:
                image.load()
                return to_uint8(image, self.in_channels, self.image_size)
        except UNREADABLE as err:
            raise unreadable(path, err) from None

    def fingerprint(self, dataset: Dataset) -> str:
        """Changes when a file of the split is added, removed, renamed or rewritten, or when the
        decoding does (its settings, `load`'s code, Pillow's and torchvision's versions): what a
        cache of its decoded images depends on."""
        digest = decoding(self.in_channels, self.image_size, inspect.getsource(type(self).load))
        for path, label in dataset.samples:
            stat = os.stat(path)
            digest.update(f"{path} {label} {stat.st_size} {stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()

    def cache_path(self, name: str) -> Path:
        return self.root / f".{name}-{self.in_channels}x{self.image_size or 'orig'}.cache.pt"

    def __str__(self) -> str:
        return str(self.root)


def read_header(path: str) -> tuple[int, int]:
    """An image's width and height, read from its header only."""
    try:
        with Image.open(path) as image:
            return image.size
    except UNREADABLE as err:
        raise unreadable(path, err) from None


def to_uint8(image: Image.Image, in_channels: int, image_size: int | None) -> torch.Tensor:
    """A PIL image as a uint8 tensor C×H×W: grey (1) or RGB (3), and with `image_size` its
    shorter side resized to it and its centre cropped square, as torchvision's Resize and
    CenterCrop do. Per-sample transforms of your own go here."""
    from torchvision.transforms import functional

    image = eight_bits(image).convert("L" if in_channels == 1 else "RGB")
    if image_size:
        image = functional.center_crop(functional.resize(image, image_size), image_size)
    return functional.pil_to_tensor(image)


def decoding(*settings: object) -> hashlib._Hash:
    """A digest of how images are decoded: `settings`, `to_uint8`'s code, and the versions of
    Pillow and torchvision. A cache of decoded images is read only while it is unchanged."""
    import PIL
    import torchvision

    versions = [PIL.__version__, torchvision.__version__]
    return hashlib.sha256(f"{list(settings)} {versions} {inspect.getsource(to_uint8)}".encode())


def eight_bits(image: Image.Image) -> Image.Image:
    """A 16-bit grey image scaled to 8 bits; Pillow's convert() would clip it (to white)."""
    if image.mode.startswith("I;16") or image.mode == "I":
        pixels = np.asarray(image, dtype=np.int64).clip(0, 65535) >> 8
        return Image.fromarray(pixels.astype(np.uint8), mode="L")
    return image


# What Pillow raises for a file it cannot decode; and for one whose header announces more than
# twice Image.MAX_IMAGE_PIXELS, a possible decompression bomb that it refuses to open.
UNREADABLE = (OSError, UnidentifiedImageError, SyntaxError, Image.DecompressionBombError)


def unreadable(path: str, err: Exception) -> UserError:
    if isinstance(err, Image.DecompressionBombError):
        return UserError(
            f"{path} is too large to open: {first_line(err)} Replace it with a smaller copy, or "
            "delete it."
        )
    return UserError(f"{path} could not be read as an image ({err}). Replace or delete it.")
