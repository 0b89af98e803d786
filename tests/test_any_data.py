"""Data that are not uint8 images, read by dataset classes of one's own (written here and named
by `dataset:`, as a fork names its own): float features with class labels, int64 tokens with
-100 padding, float pictures with float pictures as targets. Both loaders give them the very
same batches, nothing is cast or normalised, and the image keys given for them are refused."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from src.engine import guards
from src.engine.data import Data
from src.engine.errors import UserError
from src.engine.parallel import Process
from src.tasks import Classification

pytestmark = pytest.mark.unit


class Tabular:
    """Float32 features N×20, each with one of `num_classes` classes, drawn from `seed`: a class
    that takes two of Data's own keys. `whole`: the split hands its tensors over (a TensorDataset),
    else it is a list of samples, decoded one at a time."""

    def __init__(self, num_classes: int, seed: int, count: int = 90, whole: bool = True):
        self.num_classes, self.seed, self.count, self.whole = num_classes, seed, count, whole
        self.classes = [f"class {i}" for i in range(num_classes)]

    def prepare(self) -> None:
        pass

    def split(self, name: str):
        generator = torch.Generator().manual_seed(self.seed + (name == "test"))
        # Fractions and values far outside 0-255: a cast to uint8 or a division shows.
        features = torch.randn(self.count, 20, generator=generator) * 300
        labels = torch.randint(0, self.num_classes, (self.count,), generator=generator)
        return (
            TensorDataset(features, labels)
            if self.whole
            else list(zip(features, labels.tolist(), strict=True))
        )


class TorchTabular(Tabular):
    """Tabular's splits as torch's own TensorDataset (its `tensors` a tuple, not a method), or,
    with `parts=3`, a TensorDataset of three tensors, which is no (input, target) pair."""

    def __init__(self, num_classes: int, seed: int, parts: int = 2):
        super().__init__(num_classes, seed)
        self.parts = parts

    def split(self, name: str):
        features, labels = super().split(name).tensors
        return TensorDataset(features, labels, *[labels] * (self.parts - 2))


class NoisyTabular(Tabular):
    """Tabular features, with its own augmentation (`augment`, one of Data's keys): noise added
    to the training split's features."""

    def __init__(self, num_classes: int, seed: int, augment: bool = False):
        super().__init__(num_classes, seed)
        self.augment = augment

    def split(self, name: str):
        features, labels = super().split(name).tensors
        if self.augment and name == "train":
            features = features + torch.randn(features.shape, generator=torch.Generator())
        return TensorDataset(features, labels)


class Tokens:
    """Sequences of 12 int64 tokens below `vocabulary`, drawn from `seed`, and as targets the
    next tokens; past each sequence's end the inputs are 0 and the targets -100
    (cross_entropy's ignore_index). Read one sample at a time."""

    classes = None

    def __init__(self, seed: int, vocabulary: int = 50, count: int = 60, length: int = 12):
        self.seed, self.vocabulary, self.count, self.length = seed, vocabulary, count, length

    def prepare(self) -> None:
        pass

    def split(self, name: str):
        generator = torch.Generator().manual_seed(self.seed + (name == "test"))
        shape = (self.count, self.length + 1)
        tokens = torch.randint(0, self.vocabulary, shape, generator=generator)
        ends = torch.randint(self.length // 2, self.length, (self.count, 1), generator=generator)
        past = torch.arange(self.length) >= ends
        inputs, targets = tokens[:, :-1].masked_fill(past, 0), tokens[:, 1:].masked_fill(past, -100)
        return list(zip(inputs, targets, strict=True))


class Pictures:
    """Float32 3×8×8 pictures in 0-1 and, as targets, each one mirrored: inputs of an image's
    shape that are not uint8 images, and targets of that shape (for F.mse_loss)."""

    classes = None

    def __init__(self, count: int = 40):
        self.count = count

    def prepare(self) -> None:
        pass

    def split(self, name: str) -> TensorDataset:
        generator = torch.Generator().manual_seed(int(name == "test"))
        pictures = torch.rand(self.count, 3, 8, 8, generator=generator)
        return TensorDataset(pictures, pictures.flip(-1))


class Ragged:
    """Ten samples like sample 0 but one: sample 3's input is longer (`part=input`), or its
    target a float where the others' are ints (`part=target`)."""

    classes = None

    def __init__(self, part: str):
        self.part = part

    def prepare(self) -> None:
        pass

    def split(self, name: str) -> list:
        samples = [(torch.zeros(4), 1) for _ in range(10)]
        samples[3] = (torch.zeros(5), 1) if self.part == "input" else (torch.zeros(4), 0.7)
        return samples


KINDS = {
    "features": ("Tabular", {"num_classes": 3}),
    "features-one-by-one": ("Tabular", {"num_classes": 3, "whole": False}),
    "features-torch-tensordataset": ("TorchTabular", {"num_classes": 3}),
    "tokens": ("Tokens", {"num_classes": 50}),
    "pictures": ("Pictures", {}),
}


def data_of(dataset: str, **overrides) -> Data:
    args = dict(dataset=f"test_any_data.{dataset}", mean=None, std=None, num_classes=None,
                batch_size=8, test_batch_size=8, subset=None, seed=1, val_size=17,
                split_seed=0)  # fmt: skip
    return Data(**{**args, **overrides})


def ready(data: Data, rank: int = 0, world_size: int = 1) -> Data:
    data.setup(Process(rank=rank, world_size=world_size))  # the collectives of one process
    return data


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equal, dtype included (torch.equal alone compares values across dtypes)."""
    assert got.dtype == want.dtype and torch.equal(got, want)


def assert_kind(data: Data, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """A batch, empty or not, of the data's sample shapes and dtypes."""
    assert (inputs.dtype, tuple(inputs.shape[1:])) == (data.input_dtype, data.input_shape)
    assert (targets.dtype, tuple(targets.shape[1:])) == (data.target_dtype, data.target_shape)
    assert len(inputs) == len(targets)


@pytest.mark.parametrize(
    ("kind", "world_size", "num_workers"),
    [(kind, world_size, 0) for kind in KINDS for world_size in (1, 2)]
    + [pytest.param("tokens", 2, 2, id="tokens-2-workers")],  # workers: one kind suffices
)
def test_both_loaders_give_the_same_batches(kind, world_size, num_workers):
    """loader=torch (a DataLoader, one sample at a time) yields, on every rank, the very batches
    of loader=tensor, to the bit and the dtype: training (a resume's skip too), validation and
    test with FSDP's padding batches, and the raw samples. The features' 73 training samples
    in batches of 8 leave a last batch of 1, so over 2 ranks one share is empty; 17 validation
    samples give rank 1 one batch fewer, padded with an empty one."""
    dataset, options = KINDS[kind]
    empty = 0
    for rank in range(world_size):
        fast = ready(data_of(dataset, **options), rank, world_size)
        standard = ready(
            data_of(dataset, loader="torch", num_workers=num_workers, **options), rank, world_size
        )
        for epoch, skip in [(1, 0), (2, 2)]:
            got, want = (
                list(standard.train_batches(epoch, skip)),
                list(fast.train_batches(epoch, skip)),
            )
            assert len(got) == len(want) == fast.steps_per_epoch - skip
            for (inputs, targets, size), (inputs_, targets_, size_) in zip(got, want, strict=True):
                assert_same(inputs, inputs_)
                assert_same(targets, targets_)
                assert size == size_
                assert_kind(fast, inputs, targets)
                empty += len(inputs) == 0
        for split in ("val", "test"):
            got, want = (
                list(standard.eval_batches(split, even=True)),
                list(fast.eval_batches(split, even=True)),
            )
            most = math.ceil(math.ceil(fast.size(split) / world_size) / 8)  # rank 0's
            assert len(got) == len(want) == most
            for (inputs, targets), (inputs_, targets_) in zip(got, want, strict=True):
                assert_same(inputs, inputs_)
                assert_same(targets, targets_)
                assert_kind(fast, inputs, targets)
                empty += len(inputs) == 0
        for got, want in zip(standard.sample("test", 5), fast.sample("test", 5), strict=True):
            assert_same(got, want)
    if world_size == 2:
        assert empty == (3 if kind.startswith("features") else 1)  # 2 epochs' shares, 1 padding


def test_a_dataset_class_that_augments_its_own_inputs_is_left_to_it():
    """data.augment=true for a class that takes `augment`: the class augments, the engine's
    crop-and-flip of images stays off (it would need an image size these inputs lack)."""
    data = ready(data_of("NoisyTabular", num_classes=3, augment=True))
    assert data.augmentation is None and data.source.augment is True
    inputs, _, _ = next(data.train_batches(1))
    assert inputs.shape == (8, 20) and inputs.dtype == torch.float32


@pytest.mark.parametrize("loader", ["tensor", "torch"])
def test_float_features_arrive_as_they_are(loader):
    """Not divided by 255, not cast to uint8, not normalised: the dataset's own floats, in the
    sampler's order, with their int64 class labels."""
    data = ready(data_of("Tabular", num_classes=3, loader=loader))
    features, labels = Tabular(3, seed=1).split("train").tensors
    assert data.is_image is False and data.shape == data.input_shape == (20,)
    assert (data.in_channels, data.image_size) == (None, None)
    assert (data.target_shape, data.target_dtype) == ((), torch.int64)
    assert data.num_classes == 3 and data.class_names == ["class 0", "class 1", "class 2"]
    inputs, targets, size = next(data.train_batches(1))
    first = data.train_index[data.sampler.permutation()[:8]]
    assert_same(inputs, features[first])
    assert_same(targets, labels[first])
    assert size == 8 and data.normalise(inputs) is inputs
    raw, _ = data.sample("test", 90)  # the whole split
    assert_same(raw, Tabular(3, seed=1).split("test").tensors[0])


@pytest.mark.parametrize("loader", ["tensor", "torch"])
def test_tokens_stay_integers_with_their_padding(loader):
    data = ready(data_of("Tokens", num_classes=50, loader=loader))
    assert data.is_image is False and data.input_shape == data.target_shape == (12,)
    assert data.input_dtype == data.target_dtype == torch.int64 and data.num_classes == 50
    inputs, targets = data.sample("train", 43)  # the whole split
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (43, 12)
    assert (targets == -100).any() and targets.max() < 50  # the padding passed the label check
    for inputs, targets, _ in data.train_batches(1):
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs[targets == -100], torch.zeros_like(inputs[targets == -100]))


@pytest.mark.parametrize("loader", ["tensor", "torch"])
def test_float_pictures_bypass_the_image_pipeline(loader):
    """Float inputs of an image's shape are not images: not /255, not normalised, no in_channels;
    their float targets of that shape have no classes and no label check."""
    data = ready(data_of("Pictures", loader=loader, num_classes=None))
    assert data.is_image is False and data.input_shape == data.target_shape == (3, 8, 8)
    assert (data.in_channels, data.image_size, data.num_classes) == (None, None, None)
    pictures, mirrored = Pictures().split("train").tensors
    inputs, targets, _ = next(data.train_batches(1))
    first = data.train_index[data.sampler.permutation()[:8]]
    assert_same(inputs, pictures[first])
    assert_same(targets, mirrored[first])
    # A num_classes given for float targets is kept, and no target is checked against it.
    assert ready(data_of("Pictures", loader=loader, num_classes=1)).num_classes == 1


def test_a_dataset_class_receives_num_classes_and_seed():
    """Data's own keys reach the class that has a parameter of that name: none is kept from it."""
    data = ready(data_of("Tabular", num_classes=4, seed=7))
    assert (data.source.num_classes, data.source.seed) == (4, 7)
    assert data.num_classes == 4 and data.seed == 7  # Data uses them too
    assert_same(data.test[0], Tabular(4, seed=7).split("test").tensors[0])


BAD = {
    "mean for features": (
        "Tabular", {"num_classes": 3, "mean": 0.5},
        r"^data.mean=0.5 normalises uint8 C×H×W images only, but .* gives float32 20 inputs: set "
        r"data.mean and data.std to null \(normalise such inputs in the dataset class or the "
        r"model\).$",
    ),
    "std for tokens": (
        "Tokens", {"num_classes": 50, "std": [0.2]},
        r"^data.std=\[0.2\] normalises uint8 C×H×W images only, but .* gives int64 12 inputs",
    ),
    "mean and std for float pictures": (
        "Pictures", {"mean": [0.5] * 3, "std": 0.25},
        r"^data.mean=\[0.5, 0.5, 0.5\] and data.std=0.25 normalise uint8 C×H×W images only, "
        r"but .* gives float32 3×8×8 inputs",
    ),
    "augment for features": (
        "Tabular", {"num_classes": 3, "augment": True},
        r"^data.augment=true crops and flips uint8 C×H×W images only, but .* gives float32 20 "
        r"inputs: set data.augment=false.$",
    ),
    "inputs of two shapes": (
        "Ragged", {"part": "input"},
        r"^Sample 3 of the train split of .* has the input float32 5 and sample 0 float32 4: "
        r"the fast path needs one shape and dtype.$",
    ),
    "a float among int targets": (
        "Ragged", {"part": "target"},
        r"^Sample 3 of the train split of .* has the target float32 scalar and sample 0 int64 "
        r"scalar: the fast path needs one shape and dtype.$",
    ),
    "three parts to a sample": (
        "TorchTabular", {"num_classes": 3, "parts": 3},
        r"^Sample 0 of the train split of TorchTabular \(\S*tests/test_any_data.py\) has 3 parts: "
        r"a dataset gives \(input, target\) "
        r"pairs. Return each sample's input and target alone.$",
    ),
    "tokens over num_classes": (
        "Tokens", {"num_classes": 10},  # the class draws tokens below 50
        r"^The train split of .* has label 49, but data.num_classes=10. Set it to 50.$",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("how", "loader"),
    [(how, "tensor") for how in BAD] + [("three parts to a sample", "torch")],
)
def test_bad_data_are_refused_in_one_sentence(how, loader, tmp_path, monkeypatch):
    """Each before training, in setup, and nothing written (samples of any shape pass
    loader=torch's setup: its DataLoader reads them later, one batch at a time)."""
    dataset, options, message = BAD[how]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=message):
        ready(data_of(dataset, loader=loader, **options))
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def one_rank():
    """A process group of this one process (gloo), as a DDP rank has."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield Process(in_group=True)
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["tokens", "pictures"])
def test_the_drift_guard_checks_the_first_batch_of_any_targets(kind, one_rank):
    """check_first_batch gathers a hash of the first batch's targets, whatever their shape and
    dtype; the hash tells another order, another dtype and another shape apart."""
    dataset, options = KINDS[kind]
    guards.check_first_batch(ready(data_of(dataset, **options)), one_rank, Classification())
    tokens = torch.arange(24).view(2, 12)
    assert guards.digest(tokens) == guards.digest(tokens.clone())
    for other in (tokens.flip(0), tokens.int(), tokens.view(12, 2), tokens.double()):
        assert guards.digest(other) != guards.digest(tokens)
    assert isinstance(guards.digest(torch.rand(2, 3).bfloat16()), str)
