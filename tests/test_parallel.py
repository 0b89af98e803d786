"""The strategies' protocol: a parallel mode is a file and a YAML file, and one added wrongly (a
method missing, a setting without a type) is one sentence naming its file, before training. The
fork's mode trained against one process is in tests/test_equivalence.py (hooked-ddp2); a task's
state, a checkpoint part of a fork's, here too."""

import pytest
from conftest import TESTS, compose_config, last, offline_env, ok, train

from src.engine import checkpoint, parallel
from src.engine.build import build_strategy
from src.engine.errors import UserError
from src.engine.parallel.ddp import DDP
from src.engine.parallel.none import Single

FORK = f"hydra.searchpath=[file://{TESTS}/conf]"


@pytest.mark.unit
def test_each_mode_is_a_strategy_of_its_own_module():
    found = {cls.name: cls for cls in parallel.strategies()}
    assert set(found) == {"none", "dp", "ddp", "fsdp"}
    assert all(cls.__module__ == f"src.engine.parallel.{name}" for name, cls in found.items())
    assert isinstance(build_strategy({"_target_": "src.engine.parallel.none.Single"}), Single)


@pytest.mark.unit
def test_a_forks_mode_starts_from_the_one_it_varies(monkeypatch):
    """tests/conf/parallel/hooked_ddp.yaml: ddp's keys and defaults, its class, its own key."""
    monkeypatch.syspath_prepend(TESTS)
    cfg = compose_config(FORK, "parallel=hooked_ddp", "parallel.timeout=60")
    strategy = build_strategy(cfg.parallel)
    assert type(strategy).__name__ == "HookedDDP" and isinstance(strategy, DDP)
    assert (strategy.timeout, strategy.bucket_cap_mb, strategy.announce) == (60, 25, True)
    assert strategy.in_group and strategy.name == "hooked_ddp"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("hooked_ddp.Unfinished", r"^parallel: Unfinished \(tests/hooked_ddp.py\) has no "
         r"in_group, sharded, check, setup, .*no_sync, scaler.*: a strategy answers the "
         "whole protocol of src/engine/parallel/__init__.py; subclass Strategy"),
        ("hooked_ddp.Untyped", r"^tests/hooked_ddp.py: Untyped.hook = 'fp16' has no type, so it "
         "is no key of parallel: declare it as a field, `hook: str = 'fp16'`.$"),
        ("hooked_ddp.Nope", r"^parallel._target_=hooked_ddp.Nope cannot be imported"),
    ],
)  # fmt: skip
def test_a_mode_added_wrongly_is_one_sentence_naming_its_file(monkeypatch, target, message):
    monkeypatch.syspath_prepend(TESTS)
    monkeypatch.chdir(TESTS + "/..")
    with pytest.raises(UserError, match=message):
        build_strategy({"_target_": target, "hook": "fp16"})


def test_a_mode_added_wrongly_stops_the_run_before_it_trains(tmp_path, tiny_data):
    overrides = [f"data.root={tiny_data}", "logger=none", FORK, "parallel=hooked_ddp",
                 "parallel._target_=hooked_ddp.Unfinished"]  # fmt: skip
    result = train(overrides, tmp_path, env=offline_env(PYTHONPATH=TESTS))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        "parallel: Unfinished (" in result.stderr
        and "hooked_ddp.py) has no in_group" in result.stderr
    )
    assert not list((tmp_path / "outputs").rglob("metrics.jsonl"))  # nothing trained


@pytest.mark.unit
@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("KeepsAPath", r"^The checkpoint cannot hold the state of task KeepsAPath "
         r"\(tests/user_models.py\): .*Its state_dict\(\) may hold tensors and plain Python "
         "values only.$"),
        ("ForgetsAKey", r"^task ForgetsAKey \(tests/user_models.py\) cannot load the state its "
         r"own state_dict\(\) gives \(KeyError: 'count'\): a resumed run would stop there"),
    ],
)  # fmt: skip
def test_a_part_whose_state_does_not_load_is_one_sentence(monkeypatch, task, message):
    monkeypatch.syspath_prepend(TESTS)
    monkeypatch.chdir(TESTS + "/..")
    import user_models

    checkpoint.check_part("task", user_models.CountsItsSteps())  # a sound one passes
    with pytest.raises(UserError, match=message):
        checkpoint.check_part("task", getattr(user_models, task)())


def test_a_task_with_state_is_a_part_the_checkpoint_holds_and_a_resume_continues(
    tmp_path, tiny_data
):
    """A fork's task with `state_dict` and `load_state_dict`, no engine file touched: last.pt
    holds its state under `task`, and a run resumed after epoch 1 ends where the run never
    stopped ends."""
    common = [f"data.root={tiny_data}", "logger=none", "task._target_=user_models.CountsItsSteps"]
    env = offline_env(PYTHONPATH=TESTS)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ok(train([*common, "trainer.epochs=2", f"hydra.run.dir={whole}"], tmp_path, env=env))
    ok(train([*common, "trainer.epochs=1", f"hydra.run.dir={parts}"], tmp_path, env=env))
    first = last(parts)["task"]["counted"]
    ok(train([*common, "trainer.epochs=2", f"hydra.run.dir={parts}"], tmp_path, env=env))
    assert 0 < first < last(parts)["task"]["counted"] == last(whole)["task"]["counted"]
