"""Where the data come from: find (or download) a dataset's files and read each split as a
map-style `Dataset` of (input, target) pairs. The classes here give images (uint8 C×H×W) and int
labels: `IDX` (MNIST-style files), `CIFAR10`, `Torchvision` (any torchvision dataset of PIL
images) and `ImageFolder` (your own, one folder per class); one of your own may give inputs and
targets of any shape and dtype, which `src/engine/data.py` batches as they are.

Each has `prepare()` (find or download the files: one process per machine runs it while the
others wait), `split(name)` (the `train` or `test` Dataset; one with `tensors()`, as `Tensors`,
is handed over whole) and `classes` (the label names, or None, known after `split`). It is named
by `dataset:` in a `conf/data/` file and gets that file's keys that `src/engine/data.py` does
not take, and those of `src/engine/data.py`'s own (image_size, seed, …) it names. A class whose
samples are decoded one by one may have `cache_path(split)` and `fingerprint(dataset)`, as
`ImageFolder`: they are then kept decoded in that cache file.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import inspect
import logging
import math
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from src.engine import storage
from src.engine.errors import UserError, first_line

log = logging.getLogger(__name__)


class Tensors(Dataset):
    """A split already in memory: inputs N×… (uint8 images N×C×H×W, float features, tokens) and
    their targets N×…, handed over whole by `tensors()` rather than one sample at a time."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs, self.targets


def check_shape(name: str, **asked_and_had: tuple[int | None, int]) -> None:
    """Refuse a data.image_size or data.in_channels that a dataset of fixed-size images lacks."""
    for key, (asked, has) in asked_and_had.items():
        if asked not in (None, has):
            raise UserError(
                f"data.{key}={asked}, but {name} images have {has}. Leave it at {has}: only "
                "data=image_folder resizes and converts images."
            )


def torchvision_dataset(name: str) -> type:
    """A class of torchvision.datasets by name (CIFAR10), or any class by its dotted path."""
    module, _, attribute = name.rpartition(".")
    try:  # torchvision.datasets, slow to import, only where needed
        return getattr(importlib.import_module(module or "torchvision.datasets"), attribute)
    except (ImportError, AttributeError) as err:
        raise UserError(
            f"data.torchvision_class={name} is no class that can be imported ({first_line(err)}): "
            "name one of torchvision.datasets (SVHN, KMNIST, ...) or give a class's dotted path "
            "(my_package.datasets.MyDataset)."
        ) from None


class Torchvision:
    """Any torchvision dataset of (PIL image, label) samples (KMNIST, SVHN, …), asked for a split
    by `split_argument`: `train` (train=True/False, as MNIST) or `split` (split="train", as SVHN).
    Images are converted and resized as an image folder's (`in_channels`, `image_size`)."""

    what, download_size = "files", None  # for the messages (a full disk names the size)

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
        self.split_argument, self.image_size = split_argument, image_size
        self.in_channels, self.classes = in_channels, None

    def _open(self, name: str, root: Path | None = None, download: bool = False) -> Dataset:
        asked = {"train": name == "train"} if self.split_argument == "train" else {"split": name}
        folder = str(root or self.root)
        return torchvision_dataset(self.torchvision_class)(folder, download=download, **asked)

    def found(self) -> bool:
        try:
            self._open("train"), self._open("test")
        except (RuntimeError, OSError):  # torchvision: "Dataset not found or corrupted", …
            return False
        return True

    def prepare(self) -> None:
        if self.found():
            return
        reason = self._download() if self.download else "data.download=false"
        if not self.found():
            raise self.missing(reason)

    def _download(self) -> str:
        """Download with torchvision into a folder beside `root`'s files, then move them in (a
        failed download leaves no partial file); return why it brought no files."""
        name, root = self.torchvision_class, self.root
        try:  # can files be written there (the folder made if missing)?
            root.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=root).close()
        except OSError as err:
            raise UserError(
                f"{name} {self.what} not found in {root}, and data.root={root} cannot be written "
                f"to download them into ({err.strerror or err}). Set data.root to a writable "
                f"folder, or put the {self.what} in it."
            ) from None
        log.info("%s not found in %s: downloading it with torchvision", name, root)
        try:  # one staging folder per process
            with tempfile.TemporaryDirectory(
                dir=root, prefix=f".{name}.", ignore_cleanup_errors=True
            ) as staging:
                for split in ("train", "test"):
                    self._open(split, Path(staging), download=True)
                for file in sorted(p for p in Path(staging).rglob("*") if p.is_file()):
                    target = root / file.relative_to(staging)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(file, target)
        except Exception as err:  # noqa: BLE001 - any network failure means the same to the user
            return download_failed(err, root, self.download_size)
        return "the download did not bring them"

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
        return Converted(dataset, self.in_channels, self.image_size)

    def cache_path(self, name: str) -> Path:
        size = self.image_size or "orig"
        return self.root / f".{self.torchvision_class}-{name}-{self.in_channels}x{size}.cache.pt"

    def fingerprint(self, dataset: Dataset) -> str:
        """What the decoded images depend on (torchvision checks its own files)."""
        return decoding(self.in_channels, self.image_size, len(dataset)).hexdigest()

    def __str__(self) -> str:
        return f"{self.torchvision_class} in {self.root}"


class CIFAR10(Torchvision):
    """CIFAR-10 (60,000 images 32×32, 10 classes) from `root/cifar-10-batches-py`, read whole by
    torchvision's class, which checks the files' checksums."""

    download_size = "170 MB"

    def __init__(
        self,
        root: str,
        download: bool = True,
        torchvision_class: str = "CIFAR10",
        image_size: int | None = None,
        in_channels: int | None = None,
    ):
        check_shape("CIFAR-10", image_size=(image_size, 32), in_channels=(in_channels, 3))
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


class IDX(Torchvision):
    """An MNIST-style dataset (MNIST, Fashion-MNIST, ...) read straight from its four IDX files of
    28×28 grey images and labels, in `root` or torchvision's `root/<Class>/raw`."""

    what, download_size = "IDX files", "70 MB"

    def __init__(
        self,
        root: str,
        download: bool = True,
        torchvision_class: str = "MNIST",
        image_size: int | None = None,
        in_channels: int | None = None,
    ):
        check_shape(torchvision_class, image_size=(image_size, 28), in_channels=(in_channels, 1))
        super().__init__(root, torchvision_class, download, in_channels=1)  # classes: the numbers

    def found(self) -> bool:
        return find_idx_folder(self.root, self.torchvision_class) is not None

    def missing(self, reason: str) -> UserError:
        where = f"{self.root} or {self.root / self.torchvision_class / 'raw'}"
        return UserError(
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


IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path) -> torch.Tensor:
    """Read one IDX file of unsigned bytes, gzipped or not, checking its header and its length."""
    try:
        raw = path.read_bytes()
        raw = gzip.decompress(raw) if path.suffix == ".gz" else raw
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


class Converted(Dataset):
    """A dataset of (PIL image, label), its images converted and resized by `to_uint8`."""

    def __init__(self, dataset: Dataset, in_channels: int, image_size: int | None):
        self.dataset, self.in_channels, self.image_size = dataset, in_channels, image_size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.dataset[index]
        return to_uint8(image, self.in_channels, self.image_size), int(label)


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


class ImageFolder:
    """Images (any format PIL reads) in `root/train/<class>/` and `root/test/<class>/`, converted
    to grey (`in_channels=1`) or RGB (3), resized and centre-cropped to `image_size` if given;
    without it, all must share one square size."""

    def __init__(self, root: str, image_size: int | None = None, in_channels: int = 3):
        if in_channels not in (1, 3):
            raise UserError(f"data.in_channels={in_channels}: use 1 (grey) or 3 (RGB).")
        self.root, self.image_size, self.in_channels = Path(root), image_size, in_channels
        self.classes: list[str] | None = None

    def prepare(self) -> None:
        """Check the layout, the classes and the file headers (sizes), before any is decoded."""
        train, test = (self._samples(name) for name in ("train", "test"))
        if train[0] != test[0]:
            raise UserError(
                f"{self.root / 'test'} has the classes {test[0]} but {self.root / 'train'} has "
                f"{train[0]}: both need the same class folders, one per label."
            )
        sizes: dict[tuple[int, int], str] = {}
        for path, _ in train[1] + test[1]:
            with opened(path) as image:
                sizes.setdefault(image.size, path)
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
    """The image file opened by Pillow; one it cannot decode is named in one sentence, as is one
    whose header announces more than twice Image.MAX_IMAGE_PIXELS (a decompression bomb)."""
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
    """A PIL image as a uint8 tensor C×H×W, grey (1) or RGB (3), resized and centre-cropped as
    torchvision's Resize and CenterCrop do. Per-sample transforms of your own go here."""
    from torchvision.transforms import functional

    image = eight_bits(image).convert("L" if in_channels == 1 else "RGB")
    if image_size:
        image = functional.center_crop(functional.resize(image, image_size), image_size)
    return functional.pil_to_tensor(image)


def decoding(*settings: object) -> hashlib._Hash:
    """A digest of how images are decoded (`settings`, `to_uint8`'s code, Pillow's and torchvision's
    versions): a cache of decoded images is read only while it is unchanged."""
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
