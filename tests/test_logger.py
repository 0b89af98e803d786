"""wandb's mode, and a wandb that fails: training goes on with metrics.jsonl."""

import pytest
from conftest import offline_env, ok, read_metrics, run_dirs, train

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
