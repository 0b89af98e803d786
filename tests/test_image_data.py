"""Bring your own data: folders of real PNG files read by data=image_folder, CIFAR-10 read by
torchvision's own class from files in its format, and the batching every dataset shares (the
same batches from both loaders, augmentation drawn per global batch, the decoded-image cache)."""

import logging
import pickle
import struct
import zlib

import numpy as np
import pytest
import torch
from conftest import (
    assert_same_training,
    ok,
    printed,
    single_run,
    train,
    write_image_folder,
)
from PIL import Image

from src.engine.data import Data
from src.engine.errors import UserError
from src.engine.parallel import Process


def folder_data(root, **overrides) -> Data:
    args = dict(
        dataset="src.datasets.ImageFolder",
        root=str(root),
        in_channels=3,
        image_size=None,
        num_classes=None,
        mean=None,
        std=None,
        batch_size=16,
        test_batch_size=32,
        subset=None,
        seed=1,
        val_size=0.2,
        split_seed=0,
    )
    return Data(**{**args, **overrides})


def ready(data: Data, rank: int = 0, world_size: int = 1) -> Data:
    data.setup(Process(rank=rank, world_size=world_size))  # the collectives of one process
    return data


@pytest.mark.unit
def test_an_image_folder_is_read_with_its_class_names(tmp_path):
    root = write_image_folder(tmp_path, {"cat": 10, "dog": 7, "fox": 5}, size=(12, 12))
    data = ready(folder_data(root))
    assert data.class_names == ["cat", "dog", "fox"] and data.num_classes == 3
    assert data.shape == (3, 12, 12) and (data.in_channels, data.image_size) == (3, 12)
    assert data.size("train") + data.size("val") == 22 and data.size("val") == 4  # 0.2 of 22
    images, labels = data.test
    assert images.dtype == torch.uint8 and labels.tolist() == [0] * 10 + [1] * 7 + [2] * 5
    # The pixels are the files', channels first.
    png = np.array(Image.open(root / "test" / "dog" / "000.png"))
    assert torch.equal(images[10], torch.from_numpy(png).permute(2, 0, 1))


@pytest.mark.unit
def test_images_are_resized_and_centre_cropped_as_torchvision_does(tmp_path):
    from torchvision import transforms

    root = write_image_folder(tmp_path, {"a": 2, "b": 2}, size=(20, 14), mode="L")
    data = ready(folder_data(root, image_size=10, in_channels=3, val_size=0))
    expected = transforms.Compose(
        [transforms.Resize(10), transforms.CenterCrop(10), transforms.PILToTensor()]
    )(Image.open(root / "test" / "b" / "001.png").convert("RGB"))
    assert data.shape == (3, 10, 10) and torch.equal(data.test[0][3], expected)


@pytest.mark.unit
def test_mean_and_std_are_computed_from_the_training_images_and_reported(tmp_path, caplog):
    root = write_image_folder(tmp_path, {"a": 8, "b": 8})
    with caplog.at_level(logging.INFO):
        data = ready(folder_data(root))
    pixels = data.train[0].double().div(255)
    assert data.normalise.mean == pytest.approx(pixels.mean((0, 2, 3)).tolist(), abs=1e-6)
    assert data.normalise.std == pytest.approx(
        pixels.std((0, 2, 3), correction=0).tolist(), abs=1e-6
    )
    assert "computed from the 13 training images: put them in the config" in caplog.text
    given = ready(folder_data(root, mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25]))
    assert given.normalise.mean == [0.5] * 3
    assert ready(folder_data(root, mean=0.5, std=0.25)).normalise.std == [0.25] * 3
    with pytest.raises(UserError, match=r"need one value per channel: the images have 3"):
        ready(folder_data(root, mean=[0.5, 0.5], std=0.25))


@pytest.mark.parametrize("augment", [False, True])
@pytest.mark.parametrize(
    ("world_size", "num_workers"),  # worker processes take a second to start: main suite
    [pytest.param(1, 0, marks=pytest.mark.unit), pytest.param(2, 0, marks=pytest.mark.unit),
     pytest.param(2, 2, id="2-workers")],
)  # fmt: skip
def test_both_loaders_give_the_same_batches(tmp_path, augment, world_size, num_workers):
    """loader=torch reads the PNG files one at a time (in workers); loader=tensor holds them
    decoded. On every rank, in every epoch and after a resume mid-epoch, the batches are the
    same, augmented or not: the augmentation runs on the batch for both."""
    root = write_image_folder(tmp_path, {"a": 20, "b": 17})
    for rank in range(world_size):
        fast = ready(folder_data(root, augment=augment), rank, world_size)
        files = folder_data(root, augment=augment, loader="torch", num_workers=num_workers)
        ready(files, rank, world_size)
        for epoch, skip in [(1, 0), (2, 1)]:
            got, want = (
                list(files.train_batches(epoch, skip)),
                list(fast.train_batches(epoch, skip)),
            )
            assert len(got) == len(want) == 2 - skip  # 30 training images, batches of 16
            for (images, labels, size), (images_, labels_, size_) in zip(got, want, strict=True):
                assert torch.equal(images, images_) and torch.equal(labels, labels_)
                assert size == size_
        for split in ("val", "test"):
            got, want = list(files.eval_batches(split)), list(fast.eval_batches(split))
            assert len(got) == len(want)
            assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want, strict=True))


@pytest.mark.unit
@pytest.mark.parametrize("world_size", [2, 3])
def test_augmentation_does_not_depend_on_the_world_size_and_a_resume_repeats_it(
    tmp_path, world_size
):
    root = write_image_folder(tmp_path, {"a": 20, "b": 20})
    alone = ready(folder_data(root, augment=True, batch_size=12, val_size=0))
    whole = [images for images, _, _ in alone.train_batches(2)]
    shares = [
        [images for images, _, _ in ready(
            folder_data(root, augment=True, batch_size=12, val_size=0), rank, world_size
        ).train_batches(2)]
        for rank in range(world_size)
    ]  # fmt: skip
    for step, images in enumerate(whole):
        for rank in range(world_size):  # rank r holds the global batch's r-th, (r+n)-th, … image
            assert torch.equal(shares[rank][step], images[rank::world_size])
    resumed = [images for images, _, _ in alone.train_batches(2, skip=2)]
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole[2:], strict=True))
    other_epoch = next(alone.train_batches(3))[0]
    plain = ready(folder_data(root, batch_size=12, val_size=0))
    assert not torch.equal(whole[0], next(plain.train_batches(2))[0])  # it changes the images
    assert not torch.equal(other_epoch, whole[0])


@pytest.mark.unit
def test_the_augmentation_is_a_padded_random_crop_and_a_flip():
    """Each augmented image equals some crop of the image padded by `pad` black pixels, flipped
    or not; over a batch, both flips and several offsets occur."""
    from src.engine.data import Augment

    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    augmented = Augment(pad=1, seed=0, rank=0, world_size=1)(
        images, epoch=1, step=0, global_size=64
    )
    padded = torch.nn.functional.pad(images, (1, 1, 1, 1))
    seen = set()
    for image, original in zip(augmented, padded, strict=True):
        found = [
            (dy, dx, flip)
            for dy in range(3)
            for dx in range(3)
            for flip in (False, True)
            if torch.equal(
                image, (lambda c: c.flip(-1) if flip else c)(original[:, dy : dy + 8, dx : dx + 8])
            )
        ]
        assert found, "not a crop of the padded image"
        seen.add(found[0])
    assert {flip for *_, flip in seen} == {False, True} and len(seen) > 6


@pytest.mark.unit
def test_decoded_images_are_cached_beside_the_data_and_rebuilt_when_stale(tmp_path, caplog):
    root = write_image_folder(tmp_path, {"a": 6, "b": 6})
    caches = lambda: sorted(p.name for p in root.iterdir() if p.is_file())  # noqa: E731
    with caplog.at_level(logging.INFO):
        first = ready(folder_data(root))
    assert caches() == [".test-3xorig.cache.pt", ".train-3xorig.cache.pt"]
    assert "Decoding the 12 train images" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        second = ready(folder_data(root))
    assert "Decoding" not in caplog.text and torch.equal(second.train[0], first.train[0])

    # A file rewritten: that split is decoded again, with a line saying why.
    Image.new("RGB", (12, 12), (255, 0, 0)).save(root / "train" / "b" / "002.png")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        third = ready(folder_data(root, val_size=0))
    assert "the train images changed since it was written; decoding them again" in caplog.text
    assert "Decoding the 12 test images" not in caplog.text
    assert third.train[0][8].flatten(1).float().mean(1).tolist() == [255.0, 0.0, 0.0]

    # A cache cut short: rebuilt, with a line saying so; nothing half-written is left.
    cache = root / ".test-3xorig.cache.pt"
    cache.write_bytes(cache.read_bytes()[:100])
    caplog.clear()
    with caplog.at_level(logging.INFO):
        ready(folder_data(root))
    assert (
        f"{cache} cannot be read" in caplog.text and "decoding the test images again" in caplog.text
    )
    assert caches() == [".test-3xorig.cache.pt", ".train-3xorig.cache.pt"]
    assert torch.load(cache, weights_only=True)["images"].shape == (12, 3, 12, 12)


@pytest.mark.unit
def test_a_cache_that_cannot_be_written_is_left_out_with_a_line(tmp_path, caplog):
    """The data folder is only read by training: a cache the storage refuses (here a folder in
    its place) costs a line and the next run's decoding, not the run."""
    root = write_image_folder(tmp_path, {"a": 4, "b": 4})
    (root / ".train-3xorig.cache.pt").mkdir()
    with caplog.at_level(logging.INFO):
        data = ready(folder_data(root, val_size=0))
    assert data.size("train") == 8
    assert "Could not write the cache" in caplog.text and "the next run decodes them again" in (
        caplog.text
    )
    assert not list(root.glob("*.partial")) and not list(root.glob(".*.partial"))


def png_header(width: int, height: int) -> bytes:
    """A PNG file's signature, header chunk (8-bit grey) and end: all Pillow reads to open it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def bad(tmp_path, how: str):
    root = write_image_folder(tmp_path / "images", {"a": 4, "b": 4})
    if how == "empty class":
        for png in (root / "train" / "b").iterdir():
            png.unlink()
    elif how == "truncated":
        png = root / "train" / "a" / "002.png"
        png.write_bytes(png.read_bytes()[:60])
    elif how == "not an image":
        (root / "test" / "b" / "003.png").write_text("not a picture")
    elif how == "too large":  # a header announcing 20000×20000: Pillow refuses to open it
        png = root / "train" / "a" / "001.png"
        png.write_bytes(png_header(20000, 20000))
    elif how == "sizes":
        Image.new("RGB", (16, 16)).save(root / "train" / "b" / "009.png")
    elif how == "not square":
        write_image_folder(tmp_path / "wide", {"a": 2, "b": 2}, size=(16, 12))
        root = tmp_path / "wide"
    elif how == "classes":
        (root / "test" / "b").rename(root / "test" / "c")
    elif how == "no test":
        for png in (root / "test").rglob("*.png"):
            png.unlink()
        for folder in (root / "test").iterdir():
            folder.rmdir()
        (root / "test").rmdir()
    return root


BAD = {
    "empty class": r"images/train: Found no valid file for the classes b.*Every class folder "
    "needs at least one image; remove empty ones",
    "truncated": r"train/a/002.png could not be read as an image .*Replace or delete it",
    "not an image": r"test/b/003.png could not be read as an image .*Replace or delete it",
    "too large": r"train/a/001.png is too large to open: Image size \(400000000 pixels\) exceeds "
    r"limit .* Replace it with a smaller copy, or delete it\.$",
    "sizes": r"is 12×12 but .*train/b/009.png is 16×16: set data.image_size",
    "not square": r"The images are 16×12, not square: set data.image_size \(e.g. 12\)",
    "classes": r"images/test has the classes \['a', 'c'\] but .*images/train has \['a', 'b'\]",
    "no test": r"images/test is not a folder. data=image_folder reads .*/train/<class>/",
}


@pytest.mark.unit
@pytest.mark.parametrize("how", BAD)
def test_bad_image_folders_are_named_before_training(tmp_path, how):
    with pytest.raises(UserError, match=BAD[how]):
        ready(folder_data(bad(tmp_path, how)))
    assert not list((tmp_path / "images").glob(".*cache*")) or how != "truncated"


@pytest.mark.unit
def test_one_class_or_a_batch_larger_than_the_data_is_warned_about(tmp_path, caplog):
    """What a user did not mean but can train: one line each, from rank 0 only."""
    root = write_image_folder(tmp_path, {"cat": 10}, size=(12, 12))
    ready(folder_data(root, batch_size=12), rank=1, world_size=2)
    # No warning from rank 1 (its info lines show where an earlier in-process run left INFO on).
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    ready(folder_data(root, batch_size=12))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        "data.batch_size=12 is more than the 8 training samples: each step takes them all, one "
        "step an epoch. Lower data.batch_size for more steps.",
        f"{root} holds one class: a classifier is right from the start and learns nothing. Give "
        "it two classes or more.",
    ]


@pytest.mark.unit
def test_class_names_of_another_length_than_the_classes_found_are_refused(tmp_path):
    """Names for predictions.png that do not fit the folder's classes: one sentence before
    training, not an IndexError at the pictures after it (nor silence with plots=false)."""
    root = write_image_folder(tmp_path, {"cat": 4, "dog": 4, "fox": 4}, size=(12, 12))
    message = (
        r"^data.class_names has 2 names, and .* has 3 classes: give one name per class, in the "
        r"order of their numbers, or null \(the names found\)\.$"
    )
    with pytest.raises(UserError, match=message):
        ready(folder_data(root, class_names=["cat", "dog"]))


@pytest.mark.slow
def test_a_bad_image_stops_every_ddp_rank_at_once_with_its_name(tmp_path):
    """Found by the one process that decodes the images; both ranks stop before training: rank 0
    says the sentence after the run's log, and torchrun's report quotes it once (rank 0's, the
    root cause; rank 1 points to it). No cache file is written."""
    root = bad(tmp_path, "truncated")
    result = train(["data=image_folder", f"data.root={root}", "logger=none", "parallel=ddp",
                    "data.val_size=2"], tmp_path, nproc=2)  # fmt: skip
    assert result.returncode != 0
    text = printed(result)
    said, report = text.split("FAILED\n")  # the workers' output, then torchrun's report
    assert said.count("train/a/002.png could not be read as an image") == 1
    assert report.count("train/a/002.png could not be read as an image") == 1
    other_ranks = report.split("Root Cause")[0]
    assert "stopped: local rank 0 failed first, with the same mistake" in other_ranks
    assert "[rank0]" not in text and "[rank1]" not in text  # no worker's traceback
    assert not list(root.glob(".*cache*")) and not list(root.rglob("*.partial"))


def test_an_image_folder_trains_the_same_under_none_and_ddp(tmp_path):
    """Real PNG files, a CNN on 12×12 colour images with three classes found in the folders:
    one process and two DDP ranks train the same run, augmentation included."""
    root = write_image_folder(tmp_path / "images", {"cat": 40, "dog": 40, "fox": 40})
    common = ["data=image_folder", f"data.root={root}", "model=cnn", "logger=none",
              "model.dropout1=0", "model.dropout2=0",  # dropout draws differ between ranks
              "data.batch_size=16", "data.val_size=24", "trainer.epochs=2", "data.augment=true",
              "plots=true"]  # fmt: skip
    ok(train(common, tmp_path / "none"))
    ok(train([*common, "parallel=ddp"], tmp_path / "ddp", nproc=2))
    alone, ddp = single_run(tmp_path / "none"), single_run(tmp_path / "ddp")
    assert_same_training(ddp, alone)
    assert (alone / "predictions.png").is_file()


# ---------------------------------------------------------------------------------------------
# CIFAR-10, read by torchvision's CIFAR10 class from files the test writes in its format

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck"]  # fmt: skip


def write_cifar(root, per_batch: int = 8, seed: int = 0):
    """The pickled batches of cifar-10-batches-py: 5 training batches and a test batch, each a
    dict of `data` (N×3072 uint8, the red plane, then green, then blue) and `labels`."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, per_batch).tolist()}  # fmt: skip
        (folder / name).write_bytes(pickle.dumps(batch))
        batches[name] = batch
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": CIFAR_CLASSES}))
    return batches


@pytest.mark.unit
def test_cifar10_is_read_by_torchvisions_class(tmp_path):
    """torchvision checks every file's md5 against the real CIFAR-10's, so written files pass
    only through a subclass that lists their own (conftest.CIFAR10WrittenHere); the reading is
    torchvision's."""
    batches = write_cifar(tmp_path)
    data = ready(Data(dataset="src.datasets.CIFAR10", root=str(tmp_path), download=False,
                      torchvision_class="conftest.CIFAR10WrittenHere", in_channels=3,
                      image_size=32, num_classes=10, mean=[0.5] * 3, std=[0.25] * 3,
                      batch_size=8, test_batch_size=8, subset=None, seed=1, val_size=0,
                      split_seed=0))  # fmt: skip
    assert data.shape == (3, 32, 32) and data.class_names == CIFAR_CLASSES
    assert data.size("train") == 40 and data.size("test") == 8
    images, labels = data.test
    test = batches["test_batch"]
    assert torch.equal(images, torch.from_numpy(test["data"]).view(8, 3, 32, 32))
    assert labels.tolist() == test["labels"]
    first = torch.from_numpy(batches["data_batch_1"]["data"][0]).view(3, 32, 32)
    assert torch.equal(data.train[0][0], first)


@pytest.mark.unit
def test_cifar10_files_that_fail_torchvisions_checksums_are_refused(tmp_path):
    """The same files, read by torchvision's own CIFAR10 class: its checksums are the real
    dataset's, so they are refused, with what to do."""
    write_cifar(tmp_path)
    with pytest.raises(UserError, match="or its files do not match torchvision's checksums.*"
                       "and data.download=false. Point data.root at"):  # fmt: skip
        ready(Data(dataset="src.datasets.CIFAR10", root=str(tmp_path), download=False,
                   num_classes=10, mean=0.5, std=0.25, batch_size=8, test_batch_size=8,
                   subset=None, seed=1, val_size=0, split_seed=0))  # fmt: skip


def test_cifar10_that_cannot_be_downloaded_says_what_to_do(tmp_path):
    """The download cannot reach the internet here: one sentence, and the staging folder is
    gone."""
    result = train(["data=cifar10", f"data.root={tmp_path / 'empty'}", "logger=none"], tmp_path)
    assert result.returncode != 0 and "Traceback" not in printed(result)
    assert "CIFAR-10 not found in" in printed(result)
    assert "and the download failed (" in printed(result)
    assert list((tmp_path / "empty").iterdir()) == []


def test_resnet18_trains_on_cifar10(tmp_path):
    write_cifar(tmp_path / "cifar", per_batch=6)
    env_path = {"PYTHONPATH": str(__import__("conftest").__file__.rsplit("/", 1)[0])}
    from conftest import offline_env

    result = train(["data=cifar10", f"data.root={tmp_path / 'cifar'}", "data.download=false",
                    "data.torchvision_class=conftest.CIFAR10WrittenHere", "model=resnet18",
                    "data.val_size=6", "data.batch_size=8", "logger=none"],
                   tmp_path, env=offline_env(**env_path))  # fmt: skip
    ok(result)
    assert "Data: 24 training, 6 validation (data.val_size) and 6 test images of 3×32×32" in (
        printed(result)
    )


@pytest.mark.unit
def test_fixed_size_datasets_refuse_another_size_or_channel_count(tiny_data):
    from src.datasets import CIFAR10, IDX

    with pytest.raises(UserError, match="data.image_size=32, but MNIST images have 28. Leave it"):
        IDX(str(tiny_data), image_size=32)
    with pytest.raises(UserError, match="data.in_channels=1, but CIFAR-10 images have 3"):
        CIFAR10(str(tiny_data), in_channels=1)
    with pytest.raises(UserError, match="data.in_channels=2: use 1 .grey. or 3 .RGB."):
        folder_data(tiny_data, in_channels=2)


@pytest.mark.unit
def test_mean_and_std_do_not_depend_on_the_batching():
    """Summed exactly: the tensor path (chunks on the device) and loader=torch (DataLoader
    batches) normalise with the very same values, and a constant channel has a std of 0."""
    from src.engine.data import mean_and_std

    images = torch.randint(0, 256, (300, 3, 16, 16), dtype=torch.uint8)
    whole = mean_and_std(iter([images]))
    assert mean_and_std(iter(images.split(7))) == whole
    pixels = images.double().div(255)
    assert whole[0] == pytest.approx(pixels.mean((0, 2, 3)).tolist(), abs=1e-12)
    assert whole[1] == pytest.approx(pixels.std((0, 2, 3), correction=0).tolist(), abs=1e-12)
    assert mean_and_std(iter([torch.full((5, 1, 4, 4), 179, dtype=torch.uint8)]))[1] == [0.0]


@pytest.mark.unit
def test_augmentation_takes_any_seed():
    from src.engine.data import Augment

    images = torch.zeros(4, 1, 8, 8, dtype=torch.uint8)
    for seed in (0, 2**31 - 1, 10**18):
        assert Augment(1, seed, 0, 1)(images, epoch=5, step=10**6, global_size=4).shape == (
            4, 1, 8, 8
        )  # fmt: skip


@pytest.mark.unit
def test_sixteen_bit_images_are_scaled_not_clipped(tmp_path):
    root = write_image_folder(tmp_path, {"a": 2, "b": 2}, mode="L")
    ramp = (np.arange(144, dtype=np.uint16).reshape(12, 12) * 455).astype(np.uint16)
    Image.fromarray(ramp).save(root / "train" / "a" / "000.png")  # 16-bit grey, 0 to 65065
    data = ready(folder_data(root, in_channels=1, val_size=0))
    assert torch.equal(data.train[0][0, 0], torch.from_numpy((ramp >> 8).astype(np.uint8)))


@pytest.mark.parametrize("computed", [False, True], ids=["training", "mean-and-std"])
def test_a_truncated_image_read_by_a_worker_is_named_in_one_sentence(tmp_path, computed):
    """loader=torch reads the files while training: a file whose header is whole but whose
    pixels are cut short is named when it is read, without the worker's traceback."""
    root = write_image_folder(tmp_path, {"a": 6, "b": 6})
    png = root / "train" / "b" / "003.png"
    png.write_bytes(png.read_bytes()[:120])
    given = {} if computed else {"mean": [0.5] * 3, "std": [0.2] * 3}
    with pytest.raises(UserError) as raised:  # the mean and std read every image, in setup
        data = ready(folder_data(root, loader="torch", num_workers=1, val_size=0, **given))
        list(data.train_batches(1))
    assert str(raised.value).startswith(f"{png} could not be read as an image")
    assert "Traceback" not in str(raised.value)


@pytest.mark.unit
def test_predictions_show_images_from_every_class(tmp_path):
    root = write_image_folder(tmp_path, {"a": 40, "b": 40, "c": 40})
    data = ready(folder_data(root))
    images, labels = data.sample("test", 32)
    assert images.shape == (32, 3, 12, 12) and set(labels.tolist()) == {0, 1, 2}


class Numbers:
    """A dataset class of one's own, as the README describes it: prepare(), split(name) and
    classes, and only the arguments it needs."""

    def __init__(self, root: str, count: int):
        self.root, self.count, self.classes = root, count, ["even", "odd"]

    def prepare(self) -> None:
        pass

    def split(self, name: str):
        return [(torch.full((1, 4, 4), i, dtype=torch.uint8), i % 2) for i in range(self.count)]


@pytest.mark.unit
@pytest.mark.parametrize("loader", ["tensor", "torch"])
def test_a_dataset_class_of_ones_own_needs_only_what_the_readme_says(tmp_path, loader):
    data = Data(dataset="test_image_data.Numbers", root=str(tmp_path), count=40, loader=loader,
                mean=0.5, std=0.25, num_classes=None, batch_size=8, test_batch_size=8,
                subset=None, seed=1, val_size=8, split_seed=0)  # fmt: skip
    ready(data)
    assert data.class_names == ["even", "odd"] and data.num_classes == 2
    assert data.size("train") == 32 and data.shape == (1, 4, 4)
    assert sum(len(labels) for _, labels, _ in data.train_batches(1)) == 32


@pytest.mark.unit
def test_image_folder_without_a_root_says_what_to_set():
    from conftest import compose_config

    from src.engine.build import read_settings

    with pytest.raises(UserError, match=r"data.root has no value: add data.root=... to the "):
        read_settings(compose_config("data=image_folder"))


@pytest.mark.unit
@pytest.mark.parametrize("loader", ["tensor", "torch"])
def test_any_torchvision_dataset_is_read_through_its_class(tmp_path, loader):
    """data=torchvision: torchvision's MNIST class (it reads the raw files offline) gives the
    same images and labels as the template's own IDX reader."""
    from conftest import make_dataset

    make_dataset(tmp_path / "MNIST" / "raw", gz=False)
    common = dict(root=str(tmp_path), num_classes=None, mean=0.1307, std=0.3081, batch_size=16,
                  test_batch_size=32, subset=None, seed=1, val_size=50, split_seed=0)  # fmt: skip
    generic = ready(Data(dataset="src.datasets.Torchvision", torchvision_class="MNIST",
                         download=False, in_channels=1, loader=loader, **common))  # fmt: skip
    own = ready(Data(dataset="src.datasets.IDX", download=False, **{**common, "num_classes": 10}))
    assert generic.num_classes == 10 and generic.class_names[0] == "0 - zero"
    assert torch.equal(generic.sample("test", 100)[0], own.sample("test", 100)[0])
    for (images, labels, _), (images_, labels_, _) in zip(
        generic.train_batches(1), own.train_batches(1), strict=True
    ):
        assert torch.equal(images, images_) and torch.equal(labels, labels_)
    with pytest.raises(UserError, match="torchvision's KMNIST not found in .*data.download=false"):
        ready(Data(dataset="src.datasets.Torchvision", torchvision_class="KMNIST",
                   download=False, in_channels=1, **common))  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("Nope", "module 'torchvision.datasets' has no attribute 'Nope'"),
        ("my.mod.Cls", "No module named 'my'"),
    ],
)
def test_a_torchvision_class_that_does_not_exist_is_named(name, why):
    from src.datasets import torchvision_dataset

    with pytest.raises(UserError) as raised:
        torchvision_dataset(name)
    assert str(raised.value).startswith(f"data.torchvision_class={name} is no class that can be")
    assert why in str(raised.value) and "dotted path" in str(raised.value)
