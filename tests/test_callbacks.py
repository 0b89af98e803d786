"""Callbacks as a config list (`callbacks=ema`, `callbacks=[ema,watch]`), and the EMA the template
ships: the same run in every parallel mode (in float64), resumed exactly after a signal, the test
on best.pt's average; a fork's callback from its own folder that logs, keeps state and stops every
rank; and each mistake in one sentence."""

import math
import re
import signal
import textwrap

import pytest
import torch
from conftest import (
    REPO,
    TESTS,
    load,
    metric_lines,
    offline_env,
    ok,
    printed,
    read_metrics,
    read_test,
    single_run,
    start,
    train,
    wait_for,
)

FORK = [f"hydra.searchpath=[file://{TESTS}/conf]"]  # tests/conf/callbacks/watch.yaml
ENV = {"PYTHONPATH": TESTS}  # tests/user_callbacks.py
RUN = ["logger=none", "trainer.log_every_n_steps=1", "data.batch_size=8"]  # 25 steps an epoch

# float64, as tests/test_float64.py proves the modes: the same terms summed in another order move
# a step's loss by about 1e-16 of it, and 27 steps carry that to at most ~1e-14 (measured there:
# 4.9e-15 over 126 steps); the average is an elementwise mix of weights that agree so, and adds
# none. A real difference (a skipped sample, the raw weights evaluated for the average, an average
# gathered from the wrong shards) is 1e-3 or more.
RELATIVE = 1e-10
FLOAT64 = ["logger=none", "trainer.precision=64", "model=mlp", "optimizer.lr=0.05",
           "optimizer.momentum=0.9", "data.batch_size=24", "trainer.epochs=3",
           "trainer.log_every_n_steps=1", "callbacks=ema", "callbacks.ema.decay=0.9"]  # fmt: skip
# mode: (overrides, torchrun's processes). FSDP with shard_modules=[] holds every weight in its
# root unit, which FSDP keeps gathered after a forward: the average's swap must reach it.
MODES = {
    "none": ([], None),
    "dp-without-gpus": (["parallel=dp"], None),
    "ddp1": (["parallel=ddp"], 1),
    "ddp2": (["parallel=ddp"], 2),
    "ddp2-self-launched": (["parallel=ddp", "parallel.nproc_per_node=2"], None),
    "ddp3": (["parallel=ddp"], 3),
    "ddp4": (["parallel=ddp"], 4),
    "fsdp2": (["parallel=fsdp"], 2),
    "fsdp2-root-only": (["parallel=fsdp", "parallel.shard_modules=[]"], 2),
    "fsdp3": (["parallel=fsdp"], 3),
    "fsdp4": (["parallel=fsdp"], 4),
}
MAIN_TIER = ("fsdp2-root-only",)  # the mode the swap is hardest for; the rest in the slow tier


class Runs(dict):
    """Each mode's training lines, evaluations and last.pt, trained once for the tests."""

    def __init__(self, tmp_path_factory, data):
        super().__init__()
        self.tmp_path_factory, self.data = tmp_path_factory, data

    def __missing__(self, name: str):
        overrides, nproc = MODES[name]
        tmp = self.tmp_path_factory.mktemp(name)
        ok(train([f"data.root={self.data}", *FLOAT64, *overrides], tmp, nproc=nproc))
        run_dir = single_run(tmp)
        self[name] = (*read_metrics(run_dir), load(run_dir / "checkpoints" / "last.pt"))
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    return Runs(tmp_path_factory, tiny_data)


def relative(ours: float, reference: float) -> float:
    return abs(ours - reference) / max(abs(reference), 1e-300)


def farthest(ours: dict, reference: dict) -> float:
    """The largest difference of two {name: tensor} (relative to a tensor's largest value > 1)."""
    assert list(ours) == list(reference)
    return max(
        ((ours[n] - reference[n]).abs().max() / reference[n].abs().max().clamp(min=1)).item()
        for n in reference
    )


@pytest.mark.parametrize(
    "mode",
    [
        m if m in MAIN_TIER else pytest.param(m, marks=pytest.mark.slow)
        for m in MODES
        if m != "none"
    ],
)
def test_the_average_is_the_same_run_in_every_mode(runs, mode):
    """Every step's loss, the validations and the test (which evaluate the average: their counts
    exactly), the weights and the average in last.pt, against one process's, in float64."""
    ref_steps, ref_evals, ref_last = runs["none"]
    steps, evals, last = runs[mode]
    assert len(ref_steps) == 27 and [m["step"] for m in steps] == [m["step"] for m in ref_steps]
    pairs = zip(steps, ref_steps, strict=True)
    worst = max(relative(a["train/loss"], b["train/loss"]) for a, b in pairs)
    assert [m.keys() for m in evals] == [m.keys() for m in ref_evals]  # 3 validations, 1 test
    for ours, ref in zip(evals, ref_evals, strict=True):
        split = "val" if "val/loss" in ref else "test"
        assert ours[f"{split}/correct"] == ref[f"{split}/correct"]
        worst = max(worst, relative(ours[f"{split}/loss"], ref[f"{split}/loss"]))
    average, ref_average = last["callbacks"]["ema"], ref_last["callbacks"]["ema"]
    assert {t.dtype for t in average.values()} == {torch.float64}
    weights = farthest(last["model"], ref_last["model"])
    assert max(worst, weights, farthest(average, ref_average)) <= RELATIVE


def test_the_average_is_kept_validated_and_picks_best_pt(runs):
    """The average moved away from the weights (decay 0.9 over 27 steps), and the validations
    evaluate it: best.pt's pick and the test are the average's (see the next test)."""
    _, evals, last = runs["none"]
    average, weights = last["callbacks"]["ema"], last["model"]
    assert set(average) == {n for n, t in weights.items() if t.is_floating_point()}
    assert farthest(average, weights) > 1e-3
    assert evals[-1]["test/correct"] > 50  # of 100: it learned, and the average with it


def test_decay_0_and_raw_evaluate_the_weights_themselves(tmp_path, tiny_data):
    """callbacks.ema.decay=0 keeps the weights themselves, and evaluate=raw evaluates them: both
    runs log exactly what a run without the callback logs. The average of decay 0.9 does not."""
    lines = {}
    variants = {"none": [], "decay-0": ["callbacks=ema", "callbacks.ema.decay=0"],
                "raw": ["callbacks=ema", "callbacks.ema.decay=0.9", "callbacks.ema.evaluate=raw"],
                "average": ["callbacks=ema", "callbacks.ema.decay=0.9"]}  # fmt: skip
    for name, overrides in variants.items():
        ok(train([f"data.root={tiny_data}", *RUN, "trainer.epochs=2", *overrides], tmp_path / name))
        lines[name] = [m for m in read_metrics(single_run(tmp_path / name))[1]]
    assert lines["decay-0"] == lines["none"] and lines["raw"] == lines["none"]
    assert lines["average"][-1]["test/loss"] != lines["none"][-1]["test/loss"]


def test_the_test_evaluates_best_pts_average(tmp_path, tiny_data):
    """trainer.test_weights=best: the test evaluates the average best.pt holds, the one of its
    epoch (not the last epoch's): the same as evaluating that average as a model's weights."""
    run_dir = tmp_path / "run"
    overrides = [f"data.root={tiny_data}", *RUN, "trainer.epochs=3", "callbacks=ema",
                 "callbacks.ema.decay=0.9", f"hydra.run.dir={run_dir}"]  # fmt: skip
    result = ok(train(overrides, tmp_path))
    assert "The test evaluates callbacks.ema's average of these weights (decay 0.9)" in printed(
        result
    )
    best = load(run_dir / "checkpoints" / "best.pt")
    assert set(best["callbacks"]["ema"]) <= set(best["model"])
    as_weights = tmp_path / "average.pt"
    torch.save({**best["model"], **best["callbacks"]["ema"]}, as_weights)
    ok(train([f"data.root={tiny_data}", *RUN, "train=false", f"ckpt_path={as_weights}",
              f"hydra.run.dir={tmp_path / 'eval'}"], tmp_path))  # fmt: skip
    tested, evaluated = read_test(run_dir), read_test(tmp_path / "eval")
    assert tested["test/correct"] == evaluated["test/correct"]
    assert math.isclose(tested["test/loss"], evaluated["test/loss"], rel_tol=1e-6)


@pytest.mark.parametrize(
    "nproc", [None, pytest.param(2, marks=pytest.mark.slow, id="fsdp-torchrun")]
)
def test_a_signal_mid_epoch_then_the_same_command_resumes_the_average_exactly(
    tmp_path, tiny_data, nproc
):
    """SIGTERM mid-epoch, then the same command: every later loss and metric, best.pt and the
    average equal to an uninterrupted run's."""
    overrides = [f"data.root={tiny_data}", *RUN, "trainer.epochs=8", "callbacks=ema",
                 "callbacks.ema.decay=0.9"] + (["parallel=fsdp"] if nproc else [])  # fmt: skip
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ok(train([*overrides, f"hydra.run.dir={whole}"], tmp_path, nproc=nproc))
    process = start([*overrides, f"hydra.run.dir={parts}"], tmp_path / "first", nproc=nproc)
    wait_for(lambda: metric_lines(parts) >= 30, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) != 0
    stopped = load(parts / "checkpoints" / "last.pt")
    assert 25 < stopped["progress"]["step"] < 200 and stopped["progress"]["epoch_step"] != 0
    ok(train([*overrides, f"hydra.run.dir={parts}"], tmp_path, nproc=nproc))
    assert read_metrics(parts) == read_metrics(whole)
    for name in ("last.pt", "best.pt"):
        got, want = (load(d / "checkpoints" / name) for d in (parts, whole))
        for key, tensor in want["callbacks"]["ema"].items():
            assert torch.equal(got["callbacks"]["ema"][key], tensor), (name, key)


def test_a_forks_callback_logs_keeps_state_and_stops_every_rank(tmp_path, tiny_data):
    """callbacks=[ema,watch] from the fork's own conf/ folder, under torchrun: its metric in
    metrics.jsonl, its state in last.pt and best.pt, and its vote on rank 1 alone stops both
    ranks after the same step; the same command again has nothing left to train."""
    run_dir = tmp_path / "run"
    overrides = [f"data.root={tiny_data}", *RUN, *FORK, "parallel=ddp", "trainer.epochs=4",
                 "callbacks=[ema,watch]", "callbacks.watch.stop_at=30", "callbacks.watch.on_rank=1",
                 f"hydra.run.dir={run_dir}"]  # fmt: skip
    result = ok(train(overrides, tmp_path, nproc=2, env=offline_env(**ENV)))
    said = "Training ended: callbacks.watch stopped training on 1 other rank(s)."
    assert said in printed(result), printed(result)
    steps, evals = read_metrics(run_dir)
    assert steps[-1]["step"] == 30  # a logging step's check: every rank stops after it
    saved = load(run_dir / "checkpoints" / "last.pt")
    assert saved["callbacks"]["watch"] == {"steps": 30} and "ema" in saved["callbacks"]
    assert load(run_dir / "checkpoints" / "best.pt")["callbacks"]["watch"]["steps"] in (25, 30)
    logged = [m["watch/steps"] for m in map_lines(run_dir) if "watch/steps" in m]
    assert logged == [25, 30]  # each epoch's end, the cut one's too
    again = ok(train(overrides, tmp_path, nproc=2, env=offline_env(**ENV)))
    assert "Nothing left to train: the checkpoint is at the end of this run (callbacks.watch " in (
        printed(again)
    )


def map_lines(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_callback_that_fails_on_one_rank_stops_every_rank_in_one_sentence(tmp_path, tiny_data):
    """A bug in a callback's method on rank 1 only: one sentence naming the callback, its file
    and line; both ranks stopped; last.pt of epoch 1 intact."""
    run_dir = tmp_path / "run"
    overrides = [f"data.root={tiny_data}", *RUN, *FORK, "parallel=ddp", "trainer.epochs=3",
                 "callbacks=watch", "callbacks.watch.fail_at=30", "callbacks.watch.on_rank=1",
                 f"hydra.run.dir={run_dir}"]  # fmt: skip
    result = train(overrides, tmp_path, nproc=2, env=offline_env(**ENV))
    assert result.returncode != 0
    said = "tests/user_callbacks.py) failed in on_step_end with RuntimeError: a bug at step 30 (at "
    assert said in printed(result), printed(result)
    assert "Traceback (most recent call last)" not in result.stdout
    assert load(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == 25


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["callbacks=ema", "callbacks.ema._target_=src.nowhere.EMA"],
         "callbacks.ema._target_=src.nowhere.EMA cannot be imported"),
        (["+callbacks.mine.decay=0.9"], "callbacks.mine names no class: its file in "
         "conf/callbacks/ needs `mine:` with a `_target_: module.Class` under it"),
        (["callbacks=ema", "callbacks.ema._target_=src.tasks.Classification"],
         "callbacks.ema: src.tasks.Classification does not take these keys"),
        (["callbacks=ema", "callbacks.ema.decay=1"],
         "callbacks.ema.decay=1 is not allowed: use a number from 0 up to below 1"),
        (["callbacks=ema", "callbacks.ema.decay=-0.5"],
         "callbacks.ema.decay=-0.5 is not allowed: use a number from 0 up to below 1"),
        (["callbacks=ema", "callbacks.ema.evaluate=best"],
         "callbacks.ema.evaluate=best is not allowed: use average or raw"),
        ([*FORK, "callbacks=watch", "callbacks.watch.forgets_its_state=true"],
         "tests/user_callbacks.py) cannot load the state its own state_dict() gives "
         "(KeyError: 'count'): a resumed run would stop there."),
    ],
    ids=["not importable", "no _target_", "not a callback's keys", "decay 1", "decay below 0",
         "evaluate", "state that does not load"],
)  # fmt: skip
def test_each_callback_mistake_is_one_sentence_before_training(
    tmp_path, tiny_data, overrides, said
):
    result = train([f"data.root={tiny_data}", *RUN, *overrides], tmp_path, env=offline_env(**ENV))
    assert result.returncode == 1 and "Traceback" not in printed(result), printed(result)
    assert said in printed(result), printed(result)
    assert not list((tmp_path / "outputs").rglob("metrics.jsonl"))  # nothing trained


def test_a_callback_class_that_is_no_callback_is_refused(tmp_path, tiny_data):
    overrides = [f"data.root={tiny_data}", *RUN, "+callbacks.mine._target_=collections.Counter"]
    result = train(overrides, tmp_path)
    assert result.returncode == 1 and "Traceback" not in printed(result)
    assert "callbacks.mine._target_=collections.Counter is no Callback: subclass " in printed(
        result
    )


def test_an_average_resumed_from_a_checkpoint_without_one_starts_from_the_weights(
    tmp_path, tiny_data
):
    run_dir = tmp_path / "run"
    overrides = [f"data.root={tiny_data}", *RUN, f"hydra.run.dir={run_dir}"]
    ok(train([*overrides, "trainer.epochs=1"], tmp_path))
    result = ok(train([*overrides, "trainer.epochs=2", "callbacks=ema"], tmp_path))
    assert (
        "The checkpoint holds no state of callbacks.ema (saved without it): it starts afresh at "
        "step 25" in printed(result)
    )
    assert "ema" in load(run_dir / "checkpoints" / "last.pt")["callbacks"]


def test_docs_callback_is_one_python_file_and_one_yaml_file(tmp_path, tiny_data):
    """docs/layout.md's callback, its two blocks saved as they are shown into a fork's own folders
    (no engine file touched): it trains with EMA beside it, stops on its vote, and saves its
    state."""
    text = (REPO / "docs" / "layout.md").read_text()
    blocks = {}
    for block in re.findall(r"```(?:python|yaml)\n(.*?)```", text, re.S):
        block = textwrap.dedent(block)
        first = block.splitlines()[0]
        if first.startswith("# src/my_callbacks.py") or first.startswith("# conf/callbacks/"):
            blocks[first.removeprefix("# ")] = block
    assert sorted(blocks) == ["conf/callbacks/loss_floor.yaml", "src/my_callbacks.py"]
    fork = tmp_path / "fork"
    for name, block in blocks.items():
        path = fork / name.replace("src/", "")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.replace("src.my_callbacks", "my_callbacks"))
    run_dir = tmp_path / "run"
    overrides = [f"data.root={tiny_data}", *RUN, f"hydra.searchpath=[file://{fork}/conf]",
                 "callbacks=[ema,loss_floor]", "callbacks.loss_floor.floor=1.5",
                 "trainer.epochs=3", f"hydra.run.dir={run_dir}"]  # fmt: skip
    result = ok(train(overrides, tmp_path, env=offline_env(PYTHONPATH=str(fork))))
    assert "Training ended: callbacks.loss_floor stopped training: the loss is below 1.5" in (
        printed(result)
    )
    saved = load(run_dir / "checkpoints" / "last.pt")
    assert saved["callbacks"]["loss_floor"]["steps"] == saved["progress"]["step"] < 75
