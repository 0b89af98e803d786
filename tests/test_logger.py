"""wandb's mode, and a wandb that fails: training goes on with metrics.jsonl."""

import pytest
from conftest import offline_env, ok, read_metrics, run_dirs, train, wandb_records

from src.engine.logger import wandb_mode

# Skipped, not a collection error, where wandb is not installed (.ci/gpu's machine): a
# collection error would stop a `-m gpu` run that does not even select these tests.
wandb = pytest.importorskip("wandb", reason="needs wandb: pip install -r requirements.txt")

DEFAULT = wandb.Settings().base_url


@pytest.mark.unit
def test_mode_setting_then_variable_then_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode(None, DEFAULT) == "offline"  # no key anywhere: never prompt for one
    (tmp_path / "netrc").write_text(
        f"machine {DEFAULT.split('//')[1]}\n  login user\n  password {'k' * 40}\n"
    )
    assert wandb_mode(None, DEFAULT) == "online"  # `wandb login` saved a key
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(None, DEFAULT) == "disabled"
    assert wandb_mode("offline", DEFAULT) == "offline"  # logger.mode wins


@pytest.mark.slow
def test_wandb_failure_never_stops_training(tmp_path, tiny_data):
    """Online with a key but no network: one warning after the init timeout, then training."""
    env = offline_env(HOME=str(tmp_path / "home"), WANDB_API_KEY="k" * 40)
    result = ok(
        train(
            [
                f"data.root={tiny_data}",
                "logger.mode=online",
                "logger.init_timeout=5",
                "trainer.max_steps=2",
            ],
            tmp_path,
            env=env,
        )
    )
    assert "wandb did not start" in result.stdout + result.stderr
    assert "logging to metrics.jsonl only" in result.stdout + result.stderr
    (run_dir,) = run_dirs(tmp_path)
    assert read_metrics(run_dir)[1], "training went on and evaluated"


def test_a_sweeps_wandb_runs_are_named_by_what_tells_them_apart(tmp_path, tiny_data):
    """A 2-job sweep, no `.hydra/` folder written (nothing to read back: Hydra's own record of each
    job names it): each name starts with the job's number and swept value, and is cut at its far
    end; one group for the sweep."""
    env = offline_env(HOME=str(tmp_path / "home"), WANDB_MODE="offline")
    overrides = [
        f"data.root={tiny_data}",
        "trainer.max_steps=2",
        "hydra.output_subdir=null",
        "optimizer.lr=0.1,0.01",
    ]
    ok(train(["-m", *overrides], tmp_path, env=env))
    jobs = sorted((tmp_path / "outputs" / "multirun").glob("*/*/[0-9]*"))
    assert [job.name for job in jobs] == ["0", "1"] and not list(tmp_path.rglob(".hydra"))
    sweep = jobs[0].parent.relative_to(tmp_path / "outputs")
    for number, (job, lr) in enumerate(zip(jobs, ["0.1", "0.01"], strict=True)):
        (run,) = wandb_records(job, "run")
        name = run["display_name"]
        assert name.startswith(f"train #{number} optimizer.lr={lr} data.root={tiny_data} "), name
        assert len(name) == 128 and name.endswith("…"), name  # paths.log_dir=... cut
        assert run["run_group"] == f"train {sweep}"


@pytest.mark.slow
def test_self_launched_ddp_workers_name_the_run_as_the_command_line(tmp_path, tiny_data):
    """The workers of `parallel=ddp` without torchrun have no Hydra of their own: the launching
    process resolves the name in the config it hands them. No `.hydra/` to read it back from."""
    env = offline_env(HOME=str(tmp_path / "home"), WANDB_MODE="offline")
    overrides = [
        f"data.root={tiny_data}",
        "parallel=ddp",
        "parallel.nproc_per_node=2",
        "trainer.max_steps=2",
        "hydra.output_subdir=null",
    ]
    ok(train(overrides, tmp_path, env=env))
    (wandb_dir,) = (tmp_path / "outputs").rglob("wandb")
    assert not list(tmp_path.rglob(".hydra"))
    (run,) = wandb_records(wandb_dir.parent, "run")
    expected = f"train data.root={tiny_data} parallel=ddp parallel.nproc_per_node=2 trainer.max_"
    assert run["display_name"].startswith(expected), run["display_name"]
    assert (run.get("run_group"), run["job_type"]) == (None, "train")
