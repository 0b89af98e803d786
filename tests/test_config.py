"""The config tree, composed with Hydra's compose API exactly as train.py composes it."""

import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import (
    CONF,
    REPO,
    compose_config,
    offline_env,
    ok,
    printed,
    read_metrics,
    readme_commands,
    run,
    run_dirs,
    train,
)
from hydra.errors import (
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
)
from hydra.utils import instantiate
from omegaconf import OmegaConf

from src.engine.build import build_optimizer, instantiated, read_settings, typed
from src.engine.config import check_command_line
from src.engine.data import Data
from src.engine.errors import Checked, UserError, above, between, least, one_of

GROUPS = {
    group: sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    for group in ("model", "data", "task", "optimizer", "scheduler", "parallel", "logger")
}


@pytest.mark.unit
def test_every_option_composes_and_says_what_it_is():
    """A group's options are the files in its folder, found rather than listed (a fork adds a
    model by adding conf/model/<name>.yaml); each composes into the run's config and opens with a
    comment saying what it is. The tests below build each one."""
    for group, names in GROUPS.items():
        assert names, group
        for name in names:
            path = CONF / group / f"{name}.yaml"
            assert path.read_text().startswith("#"), f"{path}: open with a comment on what it is"
            assert compose_config(f"{group}={name}")[group], f"{group}={name}"


@pytest.mark.unit
@pytest.mark.parametrize("data", ["mnist", "cifar10"])
@pytest.mark.parametrize("name", GROUPS["model"])
def test_models_build_and_take_a_batch(name, data):
    """Every model takes its input's shape and its outputs from the data: 28×28 grey images in
    10 classes, and 32×32 colour ones. A classifier gives a score per class; the autoencoder,
    whose `input_shape: null` the data fills, gives back its input's shape."""
    cfg = compose_config(f"model={name}", f"data={data}")
    shape = (cfg.data.in_channels, cfg.data.image_size, cfg.data.image_size)
    found = {"input_shape": list(shape)} if cfg.model.get("input_shape", 0) is None else {}
    model = instantiate(cfg.model, **found)
    assert model(torch.zeros(2, *shape)).shape == ((2, *shape) if found else (2, 10))


@pytest.mark.unit
def test_a_setting_of_any_type_is_checked_and_one_without_a_type_is_named():
    """The README's recipe for a training setting: a field with its type, in a dataclass of the
    schema. OmegaConf checks a value against any type it declares (a list too); a key that is no
    field, or a field a fork wrote without a type, is one sentence naming the class and file."""

    @dataclass
    class Mine:
        rate: float = 0.5
        name: str | None = None
        sizes: list[int] = dataclasses.field(default_factory=list)

    assert typed(Mine, {"rate": 2, "sizes": [1, 2]}, "trainer") == Mine(2.0, None, [1, 2])
    with pytest.raises(UserError, match=r"^trainer.rate=fast is not allowed: Value 'fast' of type "
                       "'str' could not be converted to Float"):  # fmt: skip
        typed(Mine, {"rate": "fast"}, "trainer")
    with pytest.raises(UserError, match=r"^trainer.sizes\[0\]=a is not allowed: Value 'a'"):
        typed(Mine, {"sizes": ["a"]}, "trainer")
    with pytest.raises(UserError, match=r"^trainer.speed is not a key of trainer: Mine "
                       r"\(tests/test_config.py\) has no field of that name"):  # fmt: skip
        typed(Mine, {"speed": 1}, "trainer")

    @dataclass
    class Untyped(Mine):
        width = 3

    untyped = r"^tests/test_config.py: Untyped.width = 3 has no type, so it is no key of trainer: "
    with pytest.raises(UserError, match=untyped + "declare it as a field, `width: int = 3`.$"):
        typed(Untyped, {}, "trainer")

    class Undecorated(Mine):  # its annotation makes no field without @dataclass
        width: int = 3

    with pytest.raises(
        UserError, match=r"^tests/test_config.py: Undecorated.width = 3 has no type"
    ):
        typed(Undecorated, {}, "trainer")

    @dataclass
    class Shared(Mine):
        kind: ClassVar[str] = "mine"  # the class's, not a key

    with pytest.raises(UserError, match=r"^trainer.kind is not a key of trainer: Shared "):
        typed(Shared, {"kind": "yours"}, "trainer")
    with pytest.raises(UserError, match=r"no field of that name. Did you mean trainer.rate\?"):
        typed(Shared, {"rat": 1.0}, "trainer")


@pytest.mark.unit
def test_reference_architectures():
    mlp = instantiate(compose_config("model=mlp").model)
    assert [tuple(p.shape) for p in mlp.parameters()] == [(512, 784), (512,), (10, 512), (10,)]
    cnn = instantiate(compose_config("model=cnn").model)
    assert [tuple(p.shape) for p in cnn.parameters()] == [
        (32, 1, 3, 3),
        (32,),
        (64, 32, 3, 3),
        (64,),
        (128, 9216),
        (128,),
        (10, 128),
        (10,),
    ]
    assert [m.p for m in cnn.modules() if isinstance(m, torch.nn.Dropout)] == [0.25, 0.5]


@pytest.mark.unit
@pytest.mark.parametrize("optimizer", GROUPS["optimizer"])
@pytest.mark.parametrize("scheduler", GROUPS["scheduler"])
def test_optimizers_and_schedulers_build_and_step(optimizer, scheduler):
    cfg = compose_config(f"optimizer={optimizer}", f"scheduler={scheduler}")
    params = [torch.nn.Parameter(torch.ones(3))]
    assert instantiate(cfg.optimizer, params).param_groups[0]["lr"] == cfg.optimizer.lr
    opt, schedule = build_optimizer(cfg, params, total_steps=10, steps_per_epoch=1)
    sched = schedule.scheduler
    for _ in range(3):
        params[0].sum().backward()
        opt.step()
        sched.step()
    assert cfg.scheduler.interval in ("epoch", "step")


@pytest.mark.unit
@pytest.mark.parametrize("data", GROUPS["data"])
def test_data_options(data, tmp_path):
    """Every data option builds the batching and the class that reads its files, whose
    own keys (root, download, ...) it takes from the same file."""
    given = ["data.torchvision_class=KMNIST"] if data == "torchvision" else []  # its `???`
    cfg = compose_config(f"data={data}", f"data.root={tmp_path}", *given)
    dataset = instantiate(cfg.data)
    assert isinstance(dataset, Data) and dataset.source.root == tmp_path
    assert cfg.data.subset is None and cfg.data.loader == "tensor"


@pytest.mark.unit
@pytest.mark.parametrize("parallel", GROUPS["parallel"])
def test_parallel_options(parallel):
    """Each mode's file names its strategy, whose fields are its keys, with their defaults."""
    cfg = compose_config(f"parallel={parallel}")
    assert cfg.parallel._target_.startswith(f"src.engine.parallel.{parallel}.")
    assert read_settings(cfg).parallel.name == parallel


@pytest.mark.unit
def test_logger_options():
    assert compose_config("logger=none").logger._target_ is None
    wandb = compose_config("logger=wandb").logger
    assert wandb._target_ == "src.engine.logger.WandbTracker" and wandb.mode is None


@pytest.mark.unit
def test_public_contract_keys():
    """The names users and scripts rely on."""
    cfg = compose_config()
    for key in (
        "seed",
        "device",
        "trainer.epochs",
        "trainer.max_steps",
        "data.root",
        "data.batch_size",
        "data.subset",
        "logger.mode",
    ):
        assert OmegaConf.select(cfg, key, default="<absent>") != "<absent>", key
    assert cfg.device == "auto" and cfg.trainer.max_steps is None


@pytest.mark.unit
def test_unknown_option_and_key_fail_with_hydras_message():
    with pytest.raises(MissingConfigException, match="Could not find 'model/resnet'"):
        compose_config("model=resnet")
    with pytest.raises(ConfigCompositionException, match="Could not override 'trainer.epoch'"):
        compose_config("trainer.epoch=3")


def test_unknown_option_on_the_command_line(tmp_path):
    result = run([sys.executable, str(REPO / "train.py"), "optimizer=lion"], tmp_path)
    assert result.returncode != 0
    assert "Could not find 'optimizer/lion'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.unit
def test_every_yaml_key_has_a_comment():
    """Every key of every config file carries a one-line comment on its line."""
    key = re.compile(r"^\s*[\w.]+:(?!\S)")
    for path in CONF.rglob("*.yaml"):
        in_defaults = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("defaults:"):
                in_defaults = True
                continue
            if in_defaults and (line.startswith(" ") or line.startswith("-")):
                continue
            in_defaults = False
            if not key.match(line):
                continue
            is_section = line.rstrip().endswith(":")  # a block whose keys are commented
            assert is_section or "#" in line, f"{path.relative_to(REPO)}:{number} has no comment"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=0", "trainer.max_steps=0 is not allowed: use null or at least 1"),
        ("trainer.epochs=0", "trainer.epochs=0 is not allowed"),
        ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0 is not allowed"),
        ("data.subset=-5", "^data.subset=-5 is not allowed: use null or at least 1.$"),
        ("data.mean=abc", r"^data.mean=abc is not allowed: use a number, one per channel "
         r"\(\[0.5,0.5,0.5\]\) or null \(computed from the training images\).$"),
        ("data.std=[0.3,abc]", r"^data.std=\[0.3, 'abc'\] is not allowed: use a number"),
        ("data.root=123", "^data.root=123 is not allowed: use the path of the data's folder.$"),
        ("data.batch_size=0", "data.batch_size=0 is not allowed: use at least 1"),
        ("data.test_batch_size=0", "data.test_batch_size=0 is not allowed: use at least 1"),
        ("data.test_batch_size=-1", "data.test_batch_size=-1 is not allowed: use at least 1"),
        ("data.num_workers=-1", "data.num_workers=-1 is not allowed: use 0 or more"),
        ("data.std=0", "data.std=0 is not allowed: use the pixels' standard deviation, above 0"),
        ("data=cifar10 data.std=[0.2,0,0.2]", r"data.std=\[0.2, 0, 0.2\] is not allowed"),
        ("seed=-1", r"^seed=-1 is not allowed: use a whole number from 0 to 4294901760\.$"),
        (
            "scheduler.interval=epochs",
            "scheduler.interval=epochs is not allowed: use epoch or step",
        ),
        ("data.val_size=-1", "data.val_size=-1 is not allowed: use 0 .none. or more"),
        (
            "~data.in_channels",  # a dataset of other samples than images, with model=mlp
            "model.in_channels takes the data's in_channels, and data.dataset=src.datasets.IDX has "
            "none",
        ),
        (
            "checkpoint.monitor=val/f1",
            "monitor=val/f1 is not a metric this task returns: use val/loss or val/acc",
        ),
        ("checkpoint.monitor=test/acc", "checkpoint.monitor=test/acc is not allowed"),
        ("+trainer.epoch=2", r"^trainer.epoch is not a key of trainer: Trainer \(src/engine/"
         r"config.py\) has no field of that name. Did you mean trainer.epochs\? \(python "
         r"train.py --cfg job shows the keys\).$"),  # Hydra lets a `+` key into the schema
        ("+checkpoint.zzz=1", r"^checkpoint.zzz is not a key of checkpoint: .* no field of that "
         r"name. Check its spelling \(python train.py --cfg job shows the keys\).$"),
        ("parallel=ddp parallel.nproc_per_node=0", "^parallel.nproc_per_node=0 is not allowed: "
         "use null or at least 1.$"),
        ("parallel=ddp parallel.backend=mpi2", "^parallel.backend=mpi2 is not allowed: use auto, "
         "nccl or gloo.$"),
        ("parallel=ddp parallel.timeout=-1", r"^parallel.timeout=-1.0 is not allowed: use a number "
         "above 0.$"),
        ("parallel=ddp parallel.init_method=garbage://x", r"^parallel.init_method=garbage://x is "
         r"not allowed: use env:// \(torchrun's variables\), tcp://HOST:PORT or file:///PATH.$"),
        ("parallel=ddp parallel.init_method=tcp://localhost", "^parallel.init_method=tcp://"
         "localhost is not allowed: use tcp://HOST:PORT, with rank 0's host and a port from 1 "
         "to 65535.$"),
        ("parallel=ddp parallel.init_method=tcp://localhost:99999", "^parallel.init_method=tcp://"
         "localhost:99999 is not allowed: use tcp://HOST:PORT"),
        ("parallel=ddp parallel.init_method=file://relative/x", "^parallel.init_method=file://"
         "relative/x is not allowed: use file:///PATH, a file's absolute path"),
        ("seed=99999999999", r"^seed=99999999999 is not allowed: use a whole number from 0 to "
         r"4294901760\.$"),
        ("resume=a.pt init_from=b.pt", r"^resume=a.pt continues a run, its weights included, and "
         r"init_from=b.pt starts a new one from a file's weights: give one of them\.$"),
        ("logger=wandb logger.mode=bogus", r"^logger.mode=bogus is not allowed: use online, "
         r"offline, disabled or null \(\$WANDB_MODE, else online\)\.$"),
        ("logger=none logger.log_checkpoints=true", r"^logger.log_checkpoints=true logs the "
         r"run's best.pt and last.pt, and logger=none has no tracker: use logger=wandb, or set "
         r"logger.log_checkpoints=false.$"),
        ("logger=wandb logger.log_checkpoints=true checkpoint.save=false", r"^logger.log_"
         r"checkpoints=true logs the run's best.pt and last.pt, and checkpoint.save=false writes "
         r"none: drop checkpoint.save=false, or set logger.log_checkpoints=false.$"),
        ("logger=wandb logger.log_checkpoints=true train=false ckpt_path=a.pt", r"^logger.log_"
         r"checkpoints=true logs the run's best.pt and last.pt, and train=false writes none \(the "
         r"checkpoint it tests is already kept\): set logger.log_checkpoints=false.$"),
        ("resume=false", r"^resume=false is not allowed: use auto \(the run folder's last.pt\), "
         r"null \(never\) or a checkpoint's path.$"),
        ("init_from=1", "^init_from=1 is not allowed: use null or a checkpoint's path.$"),
        ("data.class_names=[a,b]", r"^data.class_names has 2 names, and data.num_classes=10: "
         r"give one name per class, in the order of their numbers \(or null: the numbers "
         r"themselves\).$"),
        ("checkpoint.mode=maximum", "checkpoint.mode=maximum is not allowed: use max, min or null"),
        (
            "checkpoint.monitor=val/loss checkpoint.mode=max",
            r"^checkpoint.mode=max keeps the worst epoch of checkpoint.monitor=val/loss, where "
            r"lower is better: use checkpoint.mode=min, or leave it null \(it follows the "
            r"monitor\)\.$",
        ),
        (
            "checkpoint.mode=min",  # val/acc
            "^checkpoint.mode=min keeps the worst epoch of checkpoint.monitor=val/acc, where "
            "higher is better: use checkpoint.mode=max",
        ),
        (
            "task._target_=user_models.SaysNoModes",  # a fork's task without modes
            r"^checkpoint.mode is null, and task=SaysNoModes does not say whether a higher or a "
            r"lower val/acc is better: set checkpoint.mode=max or min",
        ),
        (
            "task=regression checkpoint.monitor=val/mae checkpoint.mode=max",
            "^checkpoint.mode=max keeps the worst epoch of checkpoint.monitor=val/mae, where lower",
        ),
        ("trainer.test_weights=first", "test_weights=first is not allowed: use best or last"),
        ("trainer.early_stopping_patience=0", "trainer.early_stopping_patience=0 is not allowed"),
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 is not allowed"),
        ("trainer.matmul_precision=medium", "matmul_precision=medium is not allowed: use highest"),
        ("trainer.precision=8", "trainer.precision=8 is not allowed: use 32, bf16, 16 or 64"),
        (
            "parallel=ddp parallel.static_graph=true trainer.accumulate_grad_batches=2",
            "static_graph=true cannot skip the all-reduce of accumulated micro-batches",
        ),
        ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1.0 is not allowed: use null"),
        (
            "parallel=ddp parallel.check_sync_every_n_steps=0",
            "parallel.check_sync_every_n_steps=0 is not allowed: use eval .before each validation",
        ),
        (
            "parallel=ddp parallel.check_sync_every_n_steps=often",
            "parallel.check_sync_every_n_steps=often is not allowed",
        ),
        ("parallel.sync_batchnorm=true", "parallel=none trains in one: use parallel=ddp"),
        ("parallel=fsdp parallel.sync_batchnorm=true", "sync_batchnorm=true is DDP.s: parallel="),
        ("parallel=fsdp parallel.find_unused_parameters=true", "FSDP needs no search for"),
        ("parallel=fsdp trainer.channels_last=true", "FSDP shards contiguous parameters only"),
        ("checkpoint.sharded=true", "sharded=true writes each FSDP rank's shards, and parallel="),
        pytest.param(
            "parallel=ddp parallel.sync_batchnorm=true",
            "sync_batchnorm=true needs CUDA GPUs: PyTorch's SyncBatchNorm runs only there",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
        (
            "trainer.early_stopping_patience=3 data.val_size=0",
            "trainer.early_stopping_patience watches the validation split, and data.val_size=0",
        ),
        (
            "checkpoint.save=false",
            "trainer.test_weights=best tests the weights of best.pt, which checkpoint.save=false",
        ),
    ],
)  # fmt: skip
def test_values_training_cannot_use_are_refused(override, message):
    """Ranges, choices and keys against each other: one sentence, before any work."""
    read_settings(compose_config())  # the defaults pass
    with pytest.raises(UserError, match=message):
        read_settings(compose_config(*override.split()))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("data.subset=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
        ("data.batch_size=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
        ("data.batch_size=64.0", "Value '64.0' of type 'float' could not be converted to Integer"),
        ("data.batch_size=null", "field 'data.batch_size' is not Optional"),
        ("data.num_classes=ten", "could not be converted to Integer"),
        ("data.download=maybe", "Value 'maybe' is not a valid bool"),
        ("data.class_names=abc", "is not a ListConfig, list or tuple"),
        ("seed=abc", "could not be converted to Integer"),
        ("trainer.gradient_clip_val=true", "Value 'True' of type 'bool' could not be converted"),
        ("trainer.accumulate_grad_batches=2.5", "could not be converted to Integer"),
        ("parallel=ddp parallel.nproc_per_node=two", "could not be converted to Integer"),
        ("parallel=fsdp parallel.timeout=abc", "could not be converted to Float"),
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_refused_as_hydra_composes(override, said):
    """The schema's types (src/engine/config.py, each strategy's fields): Hydra refuses the value
    as it composes, naming the key, before any config is printed or any work done; and the command
    line's check says it first, in one sentence naming the key."""
    with pytest.raises(ConfigCompositionException) as raised:
        compose_config(*override.split())
    message = str(raised.value) + str(raised.value.__cause__)
    key, value = override.split()[-1].split("=")
    assert said in message and f"full_key: {key}" in message, message
    assert check_command_line(override.split()).startswith(f"{key}={value} is not allowed: use ")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("trainer.epochs=abc", "trainer.epochs=abc is not allowed: use a whole number, at least "
         "1."),
        ("data.batch_size=1.5", "data.batch_size=1.5 is not allowed: use a whole number, at least "
         "1."),
        ("data.batch_size=null", "data.batch_size=null is not allowed: use a whole number, at "
         "least 1."),
        ("checkpoint.save=maybe", "checkpoint.save=maybe is not allowed: use true or false."),
        ("-m trainer.epochs=1,abc", "trainer.epochs=abc is not allowed: use a whole number, at "
         "least 1."),  # each value of a sweep
        ("-m trainer.epochs=choice(2,true)", "trainer.epochs=true is not allowed: use a whole "
         "number, at least 1."),
        ("++trainer.epochs=1e3", "trainer.epochs=1e3 is not allowed: use a whole number, at least "
         "1."),
        ("trainer.max_steps=abc", "trainer.max_steps=abc is not allowed: use null or a whole "
         "number, at least 1."),
        ("trainer.gradient_clip_val=true", "trainer.gradient_clip_val=true is not allowed: use "
         "null (no clipping) or a norm above 0, e.g. 1.0."),
        ("trainer.test_weights=[best]", "trainer.test_weights=[best] is not allowed: use best or "
         "last."),
        ("data.class_names=abc", "data.class_names=abc is not allowed: use null or a list, [a,b]."),
        ("seed=abc", "seed=abc is not allowed: use a whole number from 0 to 4294901760."),
        ("parallel=ddp parallel.nproc_per_node=two", "parallel.nproc_per_node=two is not allowed: "
         "use null or a whole number, at least 1."),
        ("parallel.timeout=abc", "parallel.timeout=abc is not allowed: use a number above 0."),
        ("--cfg job model=cnn trainer.epochs=x", "trainer.epochs=x is not allowed: use a whole "
         "number, at least 1."),  # Hydra's flags and a group's choice around it
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_one_sentence_naming_the_type(args, message):
    """Said before Hydra composes (whose own would be 5 lines), in the out-of-range sentence's
    words: the key, and its type with its range."""
    assert check_command_line(args.split()) == message


@pytest.mark.unit
@pytest.mark.parametrize(
    "args",
    [
        "trainer.epochs=3 data.batch_size=32 checkpoint.save=false seed=7",
        "trainer.epochs='3' data.augment=no trainer.max_steps=null",  # OmegaConf converts these
        "trainer.epochs=${oc.env:EPOCHS,2}",  # an interpolation, resolved later
        "-m trainer.epochs=1,2 optimizer.lr=interval(0.001,0.1)",
        "optimizer.lr=abc model.hidden=abc data.root=5",  # a class's own keys: its own check
        "+trainer.epoch=abc ~trainer.max_steps",  # an unknown key: its own sentence
        "parallel=none parallel.timeout=abc",  # no key of that mode: its own sentence
        "callbacks=[ema,watch] callbacks.watch.every=abc",  # a list's choice, then its class's key
        "trainer.epochs=[1",  # Hydra's parser tells what it cannot read
        "trainer={epochs:abc}",  # a key inside a section's dict: Hydra's error names it
        "trainer.epochs.foo=1",  # a key under a number: Hydra's
    ],
)
def test_values_of_their_type_or_keys_the_schema_does_not_type_pass_the_check(args):
    assert check_command_line(args.split()) is None


@pytest.mark.unit
def test_hydra_full_error_leaves_a_wrong_type_to_hydra(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    assert check_command_line(["trainer.epochs=abc"]) is None


@pytest.mark.parametrize("args", [["trainer.epochs=abc"], ["-m", "trainer.epochs=1,abc"]])
def test_a_wrong_type_on_the_command_line_is_one_line(args, tmp_path):
    """python train.py: the sentence alone, exit status 1, no run folder (a sweep runs no job)."""
    result = train(args, tmp_path, own_process=True)
    said = "trainer.epochs=abc is not allowed: use a whole number, at least 1."
    assert (result.returncode, result.stderr.strip()) == (1, said), result.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


@dataclass
class Ranges(Checked):
    """A section of each range helper's fields, to hold their sentences."""

    section = "r"
    decay: float = between(0, 1, 0.5)  # [0, 1): as range() counts
    share: float = between(0, 1, 0.5, low_open=True, high_open=False)  # (0, 1]
    closed: int = between(1, 8, 1, high_open=False)  # [1, 8]
    inside: float = between(0, 1, 0.5, low_open=True)  # (0, 1)
    steps: int | None = least(1, None, nullable=True)
    clip: float | None = above(0, None, "no clipping", "a norm above 0, e.g. 1.0")
    mode: str | None = one_of("max", "min", None, default=None)
    momentum: float | None = between(0, 1, None, nullable="none", said="0 up to below 1")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("decay", 0, None),
        ("decay", 0.999, None),
        ("decay", 1, "r.decay=1 is not allowed: use 0 up to below 1."),
        ("decay", -0.5, "r.decay=-0.5 is not allowed: use 0 up to below 1."),
        ("share", 1, None),
        ("share", 0, "r.share=0 is not allowed: use above 0 up to 1."),
        ("closed", 8, None),
        ("closed", 9, "r.closed=9 is not allowed: use 1 to 8."),
        ("inside", 1.0, "r.inside=1.0 is not allowed: use above 0 and below 1."),
        ("decay", None, "r.decay=null is not allowed: use 0 up to below 1."),
        ("steps", None, None),
        ("steps", 0, "r.steps=0 is not allowed: use null or at least 1."),
        ("clip", 0, "r.clip=0 is not allowed: use null (no clipping) or a norm above 0, e.g. 1.0."),
        ("mode", None, None),
        ("mode", "best", "r.mode=best is not allowed: use max, min or null."),
        ("momentum", None, None),
        ("momentum", 1, "r.momentum=1 is not allowed: use null (none) or 0 up to below 1."),
    ],
)
def test_each_range_helper_says_what_it_allows_and_null_alike(key, value, message):
    """least, above, between and one_of: a range with one bound or two, open or closed, in one
    sentence; null, where allowed, said first ("null or", "null (what it means) or"), except in a
    list of choices, where it stands."""
    if message is None:
        assert getattr(Ranges(**{key: value}), key) == value
    else:
        with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
            Ranges(**{key: value})


def test_hydra_full_error_shows_hydras_own_report_of_a_wrong_type(tmp_path):
    env = offline_env(HYDRA_FULL_ERROR="1")
    command = [sys.executable, str(REPO / "train.py"), "trainer.epochs=abc"]
    result = run(command, tmp_path, env, own_process=True)
    assert result.returncode == 1 and "full_key: trainer.epochs" in result.stderr, result.stderr


@pytest.mark.unit
def test_a_flag_takes_yaml_s_words_for_true_and_false():
    """OmegaConf reads a flag's yes and no as true and false (`data.augment=no` is off)."""
    assert compose_config("data.augment=no").data.augment is False
    assert compose_config("parallel=ddp", "parallel.static_graph=yes").parallel.static_graph


STAND_IN = [torch.zeros(1, requires_grad=True)]  # a parameter to build an optimizer over


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "group", "message"),
    [
        ("optimizer.lr=-1", "optimizer", r"^optimizer: torch.optim.SGD refuses a value \(Invalid "
         r"learning rate: -1\)\. Fix the optimizer.\* keys \(python train.py --cfg job shows "
         r"them\)\.$"),
        ("optimizer=adam optimizer.lr=abc", "optimizer", r"^optimizer: torch.optim.Adam refuses a "
         "value"),
        ("optimizer=adam optimizer.betas=[0.9]", "optimizer", r"^optimizer: torch.optim.Adam "
         r"refuses a value \(list index out of range\)\. Fix the optimizer.\* keys"),
        ("+optimizer.foo=1", "optimizer", r"^optimizer: torch.optim.SGD does not take these keys "
         r"\(SGD.__init__\(\) got an unexpected keyword argument 'foo'\)"),
        ("+model.hiddn=3", "model", r"^model: src.models.MLP does not take these keys"),
        ("~model.num_classes", "model", r"^model: src.models.MLP needs keys the config lacks "
         r"\(.*missing 1 required .*'num_classes'\)\. Fix the model.\* keys"),
        ("model._target_=src.models.Nope", "model", r"^model._target_=src.models.Nope cannot be "
         "imported: check its module and class name"),
        ("task._target_=src.tasks.Nope", "task", r"^task._target_=src.tasks.Nope cannot be "
         "imported: check"),
        ("model._target_=broken_fork.Net", "model", r"^model._target_=broken_fork.Net cannot be "
         r"imported \(name 'nn' is not defined\): check its module and class name"),
        ("task._target_=broken_fork.Net", "task", r"^task._target_=broken_fork.Net cannot be "
         r"imported \(name 'nn' is not defined\)"),
        ("data.dataset=broken_fork.Net", "data", r"^data.dataset=broken_fork.Net is no class "
         r"that can be imported \(name 'nn' is not defined\)"),
        ("data.dataset=src.datasets.Nope", "data", r"^data.dataset=src.datasets.Nope is no class "
         r"that can be imported \(module 'src.datasets' has no attribute 'Nope'\): give a "
         "dataset class's dotted path"),
        ("data.dataset=Nope", "data", r"^data.dataset=Nope is no class that can be imported \(not "
         r"a dotted path, module.Class\)"),
    ],
)  # fmt: skip
def test_a_class_the_config_names_refusing_its_keys_is_one_sentence(override, group, message):
    cfg = compose_config(*override.split())
    args = (STAND_IN,) if group == "optimizer" else ()
    with pytest.raises(UserError, match=message):
        instantiated(group, cfg[group], *args, values=group == "optimizer")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lr=nan", r"^optimizer.lr=nan is not allowed: use a finite number\.$"),
        ("optimizer=adam +optimizer.eps=inf", r"^optimizer.eps=inf is not allowed: use a finite "),
        ("optimizer.momentum=1.5", r"^optimizer.momentum=1.5 is not allowed: use 0 up to below 1 "
         r"\(0.9 is usual\)\.$"),
    ],
)  # fmt: skip
def test_optimizer_values_torch_accepts_but_cannot_mean_are_refused(override, message):
    cfg = compose_config(*override.split())
    instantiated("optimizer", cfg.optimizer, STAND_IN, values=True)  # torch takes it
    with pytest.raises(UserError, match=message):
        build_optimizer(cfg, STAND_IN, total_steps=1, steps_per_epoch=1)
    build_optimizer(compose_config(), STAND_IN, total_steps=1, steps_per_epoch=1)


@pytest.mark.unit
def test_an_error_of_the_class_itself_keeps_its_traceback():
    """Only what the keys say is turned into a sentence: a value refused where values are not
    the class's to check (a model's, a dataset's) stays Hydra's error, with its cause."""
    with pytest.raises(InstantiationException) as raised:
        instantiated("model", {"_target_": "builtins.int", "_args_": ["x"]})
    assert isinstance(raised.value.__cause__, ValueError)


@pytest.mark.unit
@pytest.mark.parametrize("scheduler", GROUPS["scheduler"])
def test_each_shipped_schedule_steps_through_its_plan(scheduler):
    for interval in ("epoch", "step"):
        cfg = compose_config(f"scheduler={scheduler}", f"scheduler.interval={interval}")
        build_optimizer(cfg, STAND_IN, total_steps=40, steps_per_epoch=4)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scheduler=step", "scheduler.step_size=0"], r"^scheduler: torch.optim.lr_scheduler."
         r"StepLR fails at its step 1 of 10 \(epochs\) with ZeroDivisionError: integer modulo by "
         r"zero\. Fix the scheduler.\* keys"),
        # OneCycleLR cannot step past its total_steps: a plan of 40 steps given 20.
        (["scheduler=onecycle", "scheduler.total_steps=20"], r"^scheduler: torch.optim.lr_scheduler"
         r".OneCycleLR fails at its step 21 of 40 \(optimizer steps\) with ValueError: Tried to "
         "step 21 times"),
        (["scheduler=cosine", "+scheduler.foo=1"], "^scheduler: torch.optim.lr_scheduler."
         "CosineAnnealingLR does not take these keys"),
    ],
)  # fmt: skip
def test_a_schedule_that_fails_partway_is_refused_before_training(overrides, message):
    with pytest.raises(UserError, match=message):
        build_optimizer(compose_config(*overrides), STAND_IN, total_steps=40, steps_per_epoch=4)


def test_a_schedule_that_fails_partway_stops_the_run_before_it_trains(tmp_path, tiny_data):
    run_dir = tmp_path / "run"
    overrides = ["scheduler=step", "scheduler.step_size=0", f"hydra.run.dir={run_dir}"]
    result = train([f"data.root={tiny_data}", "logger=none", *overrides], tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "scheduler: torch.optim.lr_scheduler.StepLR fails at its step 1 of 1" in result.stderr
    assert not run_dir.exists()  # refused before it began: no folder left behind


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides",
    [
        "checkpoint.save=false trainer.test_weights=last",
        "checkpoint.save=false data.val_size=0",  # nothing selected: the last weights are tested
        "debug=fast",
        "debug=profile",
        "debug=overfit",
        "debug=equivalence",
        "parallel=ddp parallel.check_sync_every_n_steps=5",
        "parallel=ddp parallel.check_sync_every_n_steps=null",
        "parallel=fsdp checkpoint.sharded=true",
        "parallel=fsdp trainer.precision=16 trainer.compile=true trainer.accumulate_grad_batches=2",
        "parallel=fsdp trainer.precision=64 trainer.compile=true model=cnn_bn",
        "debug=equivalence debug.precision=train trainer.precision=bf16",
        "experiment=examples_mnist",
        pytest.param("hparams_search=optuna", marks=pytest.mark.extra("optuna")),
    ],
)
def test_the_combinations_the_template_uses_pass(overrides):
    read_settings(compose_config(*overrides.split()))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("experiment", "expected"),
    [
        (
            "examples_mnist",
            {
                "model._target_": "src.models.CNN",
                "optimizer.lr": 1.0,
                "optimizer._target_": "torch.optim.Adadelta",
                "scheduler.gamma": 0.7,
                "scheduler.step_size": 1,
                "data.batch_size": 64,
                "trainer.epochs": 14,
                "seed": 1,
                "data.torchvision_class": "MNIST",
            },
        ),
        (
            "fashion_mlp",
            {"model._target_": "src.models.MLP", "data.torchvision_class": "FashionMNIST"},
        ),
        (
            "fashion_cnn",
            {"model._target_": "src.models.CNN", "data.torchvision_class": "FashionMNIST"},
        ),
        (
            "fashion_cnn_fast",
            {
                "model._target_": "src.models.CNN",
                "data.batch_size": 1024,
                "trainer.precision": "bf16",
                "trainer.channels_last": True,
                "trainer.compile": "reduce-overhead",
                "trainer.warmup_steps": 5,
                "scheduler.total_steps": None,  # filled in with the run's steps
            },
        ),
    ],
)
def test_experiments_set_their_recipe(experiment, expected):
    cfg = compose_config(f"experiment={experiment}")
    assert {key: OmegaConf.select(cfg, key) for key in expected} == expected
    # Command-line overrides still win over the experiment.
    assert compose_config(f"experiment={experiment}", "trainer.epochs=2").trainer.epochs == 2


@pytest.mark.unit
def test_debug_fast_and_overfit_compose():
    fast = compose_config("debug=fast")
    assert (fast.trainer.max_steps, fast.checkpoint.save, fast.logger._target_, fast.plots) == (
        5,
        False,
        None,
        False,
    )
    overfit = compose_config("debug=overfit")
    assert overfit.data.subset == overfit.data.batch_size == 32


def test_overfitting_one_batch_drives_the_loss_near_zero(tmp_path, tiny_data):
    overrides = ["debug=overfit", "trainer.log_every_n_steps=1", "tags=[smoke,overfit]"]
    result = ok(train([f"data.root={tiny_data}", *overrides], tmp_path))
    (run_dir,) = run_dirs(tmp_path)
    steps, _ = read_metrics(run_dir)
    assert steps[0]["train/loss"] > 1.0 and steps[-1]["train/loss"] < 0.05, steps[-1]
    saved = OmegaConf.load(run_dir / "config_resolved.yaml")
    assert (saved.task_name, list(saved.tags)) == ("train", ["smoke", "overfit"])
    assert not (run_dir / "checkpoints").exists()
    # Its verdict, in a few lines: one "epoch N trained" line every 50 epochs, then passed.
    output = printed(result)
    assert output.count("trained in") == 4, output
    assert re.search(r"debug=overfit passed: the training loss fell to \S+ after 200 steps on 32 "
                     r"samples, below 0.05 \(debug.overfit_below\)\.", output)  # fmt: skip
    # A rate too small to learn anything: failed, exit 1, with the loss reached.
    failed = train([f"data.root={tiny_data}", "debug=overfit", "optimizer.lr=1e-9"], tmp_path)
    assert failed.returncode == 1, printed(failed)
    failure = r"debug=overfit failed: the training loss is \S+ after 200 steps on 32 samples, not "
    assert re.search(failure + r"below 0.05 \(debug.overfit_below\)", printed(failed))


def test_debug_fast_evaluates_a_few_batches_of_each_split(tmp_path, tiny_data):
    """As Lightning's fast_dev_run: the validation and the test on their first images only
    (data.eval_subset), in every mode alike."""
    result = ok(train([f"data.root={tiny_data}", "debug=fast", "data.eval_subset=20"], tmp_path))
    said = "Data: 200 training, 20 validation (data.val_size) and 20 test images of 1×28×28 from "
    assert said in printed(result) and "(data.eval_subset=20: the first of each" in printed(result)


@pytest.mark.slow
def test_profile_writes_a_trace_of_the_steps(tmp_path, tiny_data):
    """The trace, one file per rank, and where it is with the ten costliest operations said;
    no device error from the profiler on a CPU."""
    result = ok(train([f"data.root={tiny_data}", "debug=profile"], tmp_path))
    (run_dir,) = run_dirs(tmp_path)
    output = printed(result)
    assert f"Trace of 5 steps in {run_dir / 'profile'}/, a file per rank" in output, output
    assert "Self CPU time total" in output and "gpuGetDeviceCount" not in output, output
    (trace,) = (run_dir / "profile").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("ProfilerStep#") for n in names) and "aten::linear" in names


# The README's two searches (tests/test_readme.py leaves them to this test), and one that
# minimises.
SEARCHES = [c.split()[2:] for c in readme_commands() if "hparams_search=optuna" in c]
assert len(SEARCHES) == 2, SEARCHES


@pytest.mark.parametrize(
    ("overrides", "best_of"),
    [
        *(pytest.param(search, max, marks=pytest.mark.slow) for search in SEARCHES),
        pytest.param(
            ["-m", "hparams_search=optuna", "checkpoint.monitor=val/loss", "checkpoint.mode=min"],
            min,
            marks=pytest.mark.slow,
        ),
    ],
)
@pytest.mark.extra("optuna")
def test_optuna_search_optimises_the_monitor(tmp_path, tiny_data, overrides, best_of):
    """A 2-trial TPE search (requirements-optuna.txt); under parallel=ddp, DDP groups. Each trial's
    value is its best validation value of checkpoint.monitor (the highest val/acc; the lowest
    val/loss under checkpoint.mode=min), never a test value; the best trial is the best of them."""
    monitor = "val/loss" if best_of is min else "val/acc"
    result = train(
        [
            *overrides,
            "hydra.sweeper.n_trials=2",
            f"data.root={tiny_data}",
            "logger=none",
            "trainer.max_steps=3",
        ],
        tmp_path,
    )
    ok(result)
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    best = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    jobs = sorted(sweep_dir.glob("[0-9]"))
    values = [best_of(m[monitor] for m in read_metrics(job)[1][:-1]) for job in jobs]
    if best_of is min:  # losses rarely tie, accuracies on tiny data may
        assert len(set(values)) == 2, "two trials that differ, or the direction goes untested"
    assert len(values) == 2 and best.best_value == best_of(values)
    assert set(best.best_params) == {"optimizer", "optimizer.lr", "data.batch_size"}


@pytest.mark.unit
@pytest.mark.extra("optuna")
@pytest.mark.parametrize(
    ("overrides", "direction"),
    [
        ([], "maximize"),  # val/acc, checkpoint.mode null: the task's way
        (["checkpoint.monitor=val/loss"], "minimize"),
        (["task=regression", "checkpoint.monitor=val/mae"], "minimize"),
        (["checkpoint.mode=max"], "maximize"),
        (["checkpoint.monitor=val/loss", "checkpoint.mode=min"], "minimize"),
        (["task._target_=user_models.SaysNoModes", "checkpoint.mode=min"], "minimize"),
    ],
)
def test_the_optuna_direction_follows_checkpoint_mode(overrides, direction):
    """The sweeper as Hydra builds it for `-m` (from the whole config, where the direction's
    `${checkpoint_mode:}` finds checkpoint.mode, or the task's way for the monitor where it is
    null); its directions are what it creates the study with."""
    from hydra import compose, initialize_config_dir
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext

    overrides = ["hparams_search=optuna", *overrides]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        config = compose("config", overrides=overrides, return_hydra_config=True)
    assert config.hydra.sweeper.direction == direction
    sweeper = Plugins.instance().instantiate_sweeper(
        config=config,
        hydra_context=HydraContext(config_loader=None, callbacks=None),
        task_function=None,
    )
    assert sweeper.sweeper._get_directions() == [direction]


def test_a_wrong_type_under_torchrun_is_said_once(tmp_path):
    """Every rank reads the same command line: local rank 0 says it, the others exit with 1."""
    result = train(["parallel=ddp", "trainer.epochs=abc"], tmp_path, nproc=2)
    said = "trainer.epochs=abc is not allowed: use a whole number, at least 1."
    assert result.returncode != 0 and printed(result).count(said) == 1, printed(result)
    assert not (tmp_path / "outputs").exists()
