"""The data path: IDX files read through the real loading code, and the sample order."""

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    TRAIN_SIZE,
    VAL_SIZE,
    make_dataset,
    offline_env,
    ok,
    run,
    train,
    write_idx,
)
from torch.utils.data import DistributedSampler

from src.datasets import IDX, find_idx_folder, read_idx
from src.engine.data import Data, GlobalBatchSampler
from src.engine.errors import UserError
from src.engine.parallel import Process


def mnist(root, **overrides) -> Data:
    args = dict(
        dataset="src.datasets.IDX",
        root=str(root),
        torchvision_class="MNIST",
        download=False,
        mean=0.1307,
        std=0.3081,
        num_classes=10,
        batch_size=64,
        test_batch_size=1000,
        subset=None,
        seed=1,
        val_size=VAL_SIZE,
        split_seed=0,
    )
    return Data(**{**args, **overrides})


@pytest.mark.unit
def test_a_root_under_home_is_expanded(tmp_path, monkeypatch):
    """data.root="~/mnist" reads the user's folder, not a folder named ~ in the working one."""
    make_dataset(tmp_path / "home" / "mnist")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    data = mnist("~/mnist")
    data.setup(Process())
    assert len(data.test[1]) == 100 and not (tmp_path / "~").exists()


@pytest.mark.unit
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path, gz):
    array = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    path = write_idx(tmp_path / "images", array, gz=gz)
    assert torch.equal(read_idx(path), torch.from_numpy(array))


@pytest.mark.unit
def test_finds_flat_and_torchvision_layouts(tmp_path):
    make_dataset(tmp_path / "flat", gz=True)
    make_dataset(tmp_path / "tv" / "MNIST" / "raw", gz=False)
    assert find_idx_folder(tmp_path / "flat", "MNIST") == tmp_path / "flat"
    assert find_idx_folder(tmp_path / "tv", "MNIST") == tmp_path / "tv" / "MNIST" / "raw"
    assert find_idx_folder(tmp_path / "tv", "FashionMNIST") is None


def test_loads_splits_onto_the_device(tmp_path):
    data = mnist(make_dataset(tmp_path), subset=50)
    data.setup(Process())
    images, labels = data.train
    assert images.shape == (50, 1, 28, 28) and images.dtype == torch.uint8
    assert labels.dtype == torch.long and len(data.test[1]) == 100
    x, y, n = next(data.train_batches(1))
    assert x.shape == (50, 1, 28, 28) and x.dtype == torch.float32 and n == 50
    # Normalised as torchvision's ToTensor() + Normalize(mean, std) would.
    first = data.sampler.permutation()[0]
    assert torch.allclose(x[0], (images[first].float() / 255 - 0.1307) / 0.3081)


@pytest.mark.unit
def test_corrupt_files_are_named(tmp_path):
    folder = make_dataset(tmp_path, gz=True)
    path = folder / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:200])  # a download cut short
    with pytest.raises(UserError, match="train-images-idx3-ubyte.gz.*truncated"):
        mnist(folder).setup(Process())

    labels = folder / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(b"<html>not found</html>"))  # an error page saved as data
    with pytest.raises(UserError, match="t10k-labels-idx1-ubyte.gz is not an IDX file"):
        read_idx(labels)

    raw = write_idx(tmp_path / "short", np.zeros((10, 28, 28), np.uint8))
    raw.write_bytes(raw.read_bytes()[:-1])
    with pytest.raises(UserError, match="short is truncated or corrupt"):
        read_idx(raw)

    for name, array in (("no-images", np.zeros((0, 28, 28), np.uint8)), ("no-labels", [])):
        empty = write_idx(tmp_path / name, np.asarray(array, np.uint8))
        what = name.removeprefix("no-")
        with pytest.raises(UserError, match=rf"{name} holds no {what} \(its header announces "):
            read_idx(empty)


@pytest.mark.unit
def test_files_that_do_not_match_are_refused(tmp_path):
    folder = make_dataset(tmp_path, gz=False)
    write_idx(folder / "t10k-labels-idx1-ubyte", np.zeros(99, np.uint8))
    with pytest.raises(UserError, match="do not belong together"):
        mnist(folder).setup(Process())


@pytest.mark.unit
def test_batch_size_must_divide_over_the_ranks(tmp_path):
    with pytest.raises(UserError, match=r"data.batch_size=64 does not divide over 3 processes"):
        mnist(tmp_path).setup(Process(world_size=3, in_group=True))


@pytest.mark.unit
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_order_is_distributed_samplers_when_counts_divide(world_size):
    """Each rank's samples are exactly those DistributedSampler gives it, in its order."""
    n, batch = 256, 64
    for rank in range(world_size):
        ours = GlobalBatchSampler(n, batch, rank, world_size, seed=5)
        theirs = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=5)
        for epoch in (1, 2):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert [i for b in ours for i in b] == list(theirs)


@pytest.mark.unit
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_global_batches_do_not_depend_on_world_size(world_size):
    """Each epoch covers every sample once, in the same global batches for any world size."""
    n, batch = TRAIN_SIZE, 12  # 200 = 16 batches of 12 and a last one of 8
    reference = GlobalBatchSampler(n, batch, 0, 1, seed=3)
    reference.set_epoch(4)
    samplers = [GlobalBatchSampler(n, batch, r, world_size, seed=3) for r in range(world_size)]
    for s in samplers:
        s.set_epoch(4)
    for expected, shares in zip(reference, zip(*samplers, strict=True), strict=True):
        assert sorted(i for share in shares for i in share) == sorted(expected)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # no padding, no repeats


def test_missing_data_says_what_to_do(tmp_path):
    """No files and no network: a short message, no traceback."""
    result = train(["data.root=" + str(tmp_path / "empty"), "logger=none"], tmp_path)
    assert result.returncode != 0
    assert "MNIST IDX files not found in" in result.stderr
    assert "the download failed" in result.stderr
    assert "data=fashion_mnist data.root=/usr/share/datasets/fashion-mnist" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.unit
def test_a_missing_file_of_the_four_is_named_and_a_mistyped_root_is_not_made(tmp_path):
    """One IDX file missing: the sentence names it (not a failed download of another); a
    data.root under a folder that does not exist is refused before a download, not created."""
    folder = make_dataset(tmp_path / "data")
    (folder / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(UserError, match=rf"^{folder} lacks t10k-images-idx3-ubyte \(gzipped or "
                       r"not\) of the four MNIST IDX files, and data.download=false"):  # fmt: skip
        IDX(str(folder), download=False).prepare()
    mistyped = tmp_path / "no" / "such"
    with pytest.raises(UserError, match="cannot be written to download them into"):
        IDX(str(mistyped)).prepare()
    assert not (tmp_path / "no").exists()


def test_corrupt_file_stops_the_run_with_its_name(tmp_path):
    folder = make_dataset(tmp_path / "data")
    path = folder / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:100])
    result = train([f"data.root={folder}", "logger=none"], tmp_path)
    assert result.returncode != 0
    assert f"Could not read {path}" in result.stderr
    assert "Traceback" not in result.stderr


def test_fashion_mnist_package_layout(tmp_path):
    """The four gzipped files side by side, as Debian's dataset-fashion-mnist installs them."""
    folder = make_dataset(tmp_path / "fashion-mnist", gz=True)
    ok(
        train(
            ["data=fashion_mnist", f"data.root={folder}", "logger=none", "trainer.max_steps=1"],
            tmp_path,
        )
    )


DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")  # apt-get install dataset-fashion-mnist


@pytest.mark.unit
@pytest.mark.skipif(
    not DEBIAN_FASHION.is_dir(), reason="needs dataset-fashion-mnist (.ci/run installs it)"
)
def test_another_idx_datasets_files_are_named(tmp_path):
    """Fashion-MNIST's published files given as MNIST's (data=mnist) are named, not trained on:
    the four files of one IDX dataset look like any other's."""
    with pytest.raises(UserError) as refused:
        mnist(DEBIAN_FASHION).setup(Process())
    assert str(refused.value) == (
        f"{DEBIAN_FASHION} holds FashionMNIST's IDX files, not MNIST's (train-labels-idx1-ubyte.gz "
        f"is FashionMNIST's). Train on them with data=fashion_mnist data.root={DEBIAN_FASHION}, "
        "or point data.root at MNIST's files."
    )
    mnist(DEBIAN_FASHION, torchvision_class="FashionMNIST").setup(Process())  # as its own: read


def test_offline_env_blocks_downloads(tmp_path):
    """The guard the tests rely on: with offline_env no download can succeed."""
    code = "import urllib.request as u; u.urlopen('http://example.com', timeout=5)"
    result = run([__import__("sys").executable, "-c", code], tmp_path, offline_env())
    assert result.returncode != 0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("world_size", "num_workers"), [(1, 0), (2, 0), pytest.param(2, 2, id="2-workers")]
)
def test_torch_loader_gives_the_tensor_loaders_batches(tiny_data, world_size, num_workers):
    """data.loader=torch (a DataLoader, one sample at a time) yields, on every rank, the very
    batches of data.loader=tensor: the same samples, order, normalisation and global sizes;
    also when resuming in the middle of an epoch."""
    for rank in range(world_size):
        process = Process(
            rank=rank, world_size=world_size
        )  # the collectives of one process suffice
        fast, standard = mnist(tiny_data), mnist(tiny_data, loader="torch", num_workers=num_workers)
        fast.setup(process)
        standard.setup(process)
        for epoch, skip in [(1, 0), (2, 0), (2, 2)]:
            got = list(standard.train_batches(epoch, skip))
            want = list(fast.train_batches(epoch, skip))
            assert len(got) == len(want) == 4 - skip  # ceil(200 / 64) batches
            for (images, labels, size), (images_, labels_, size_) in zip(got, want, strict=True):
                assert torch.equal(images, images_) and torch.equal(labels, labels_)
                assert size == size_
        for split in ("val", "test"):
            got, want = list(standard.eval_batches(split)), list(fast.eval_batches(split))
            assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want, strict=True))


@pytest.mark.unit
def test_torch_loader_handles_an_empty_share_of_the_last_batch(tmp_path):
    """201 images in batches of 4 over 4 ranks: the last batch holds 1 image, so 3 ranks get
    none; the DataLoader path must give them an empty batch, as the tensor path does."""
    make_dataset(tmp_path, train_size=201, test_size=8)
    for rank in range(4):
        data = mnist(tmp_path, loader="torch", batch_size=4, val_size=0)
        data.setup(Process(rank=rank, world_size=4))
        *_, (images, labels, size) = data.train_batches(1)
        assert size == 1 and len(labels) == (rank == 0) and images.shape[1:] == (1, 28, 28)


@pytest.mark.unit
def test_unknown_loader_is_refused(tiny_data):
    with pytest.raises(UserError, match="data.loader=fast is not a loader: use tensor or torch"):
        mnist(tiny_data, loader="fast")


def numbered_dataset(folder, count: int = 300):
    """Training images that carry their own position in the file, in their first two pixels."""
    make_dataset(folder, train_size=count)
    images = np.zeros((count, 28, 28), np.uint8)
    images[:, 0, 0], images[:, 0, 1] = np.arange(count) % 256, np.arange(count) // 256
    write_idx(folder / "train-images-idx3-ubyte", images, gz=True)
    return folder


def positions(images: torch.Tensor) -> list[int]:
    """The file positions numbered_dataset wrote into `images`, read back through the
    normalisation (mean 0.1307, std 0.3081) the batches went through."""
    pixels = ((images[:, 0, 0, :2] * 0.3081 + 0.1307) * 255).round().long()
    return (pixels[:, 0] + 256 * pixels[:, 1]).tolist()


@pytest.mark.unit
@pytest.mark.parametrize("world_size", [1, 3])
def test_training_and_validation_never_share_an_image(tmp_path, world_size):
    """Read back from the batches themselves: over an epoch the ranks train on every image
    outside the validation split once, and validate on every image inside it once."""
    numbered_dataset(tmp_path)
    trained, validated = [], []
    for rank in range(world_size):
        data = mnist(tmp_path, batch_size=12, val_size=70)
        data.setup(Process(rank=rank, world_size=world_size))
        trained += [i for images, _, _ in data.train_batches(1) for i in positions(images)]
        validated += [i for images, _ in data.eval_batches("val") for i in positions(images)]
    assert sorted(validated) == data.val_index.tolist() and len(validated) == 70
    assert sorted(trained) == data.train_index.tolist() and len(trained) == 230
    assert not set(trained) & set(validated)
    assert sorted(trained + validated) == list(range(300))


@pytest.mark.unit
def test_the_validation_split_depends_on_split_seed_alone(tmp_path):
    """Not on seed, the world size, the loader, data.subset or the epoch: every job of a sweep
    and every parallel mode validates on the same images."""
    numbered_dataset(tmp_path)
    reference = mnist(tmp_path)
    reference.setup(Process())
    for overrides, process in [
        ({"seed": 7}, Process()),
        ({}, Process(rank=2, world_size=4)),
        ({"loader": "torch"}, Process()),
        ({"subset": 40}, Process()),
    ]:
        data = mnist(tmp_path, **overrides)
        data.setup(process)
        assert torch.equal(data.val_index, reference.val_index), overrides
        ours, theirs = data.sample("val", 1000), reference.sample("val", 1000)  # the whole split
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    subset = mnist(tmp_path, subset=40)
    subset.setup(Process())
    assert torch.equal(subset.train_index, reference.train_index[:40])  # the first 40 of the rest
    other = mnist(tmp_path, split_seed=1)
    other.setup(Process())
    assert not torch.equal(other.val_index, reference.val_index)


def test_val_size_zero_holds_nothing_out(tmp_path):
    numbered_dataset(tmp_path)
    data = mnist(tmp_path, val_size=0)
    data.setup(Process())
    assert len(data.train[1]) == 300 and len(data.val[1]) == 0
    assert list(data.eval_batches("val")) == []


def test_a_validation_split_that_leaves_no_training_images_is_refused(tmp_path, tiny_data):
    result = train([f"data.root={tiny_data}", "logger=none", "data.val_size=250"], tmp_path)
    assert result.returncode != 0
    assert "data.val_size=250 leaves no training images: the training split" in result.stderr
    assert "holds 250. Hold out fewer (0 for none)." in result.stderr
    assert "Traceback" not in result.stderr
