"""What a run and a sweep report, for any task: the sweep's summary.csv and table, curves.png and
predictions.png, from real metrics.jsonl files, with Hydra's own config and real matplotlib."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import CONF, VAL_SIZE, compose_config
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from hydra.utils import instantiate
from PIL import Image
from torch import nn

from src.engine.app import SweepSummary, _write
from src.engine.guards import NonFiniteLoss
from src.engine.parallel import Process
from src.engine.tools import plots
from src.tasks import Classification, Regression

pytestmark = pytest.mark.unit


def run_records(metric: str, values: list[float], test: float | None, val: bool = True) -> list:
    """metrics.jsonl of a 3-epoch run of 2 steps an epoch that logs `metric` (acc, as
    classification does with its count `correct`; or mae), validated after each epoch (`val`),
    and tested on the weights of epoch 2 if `test` is given."""
    counted = metric == "acc"  # classification logs its count of correct predictions too
    records = []
    for epoch, value in enumerate(values, 1):
        records.append({"step": 2 * epoch - 1, "epoch": epoch, "train/loss": 1.0 / epoch})
        records.append({"step": 2 * epoch, "epoch": epoch, "train/loss": 0.9 / epoch})
        if val:
            record = {"step": 2 * epoch, "epoch": epoch, "val/loss": 0.5 / epoch}
            record[f"val/{metric}"] = value
            records.append({**record, "val/correct": 40} if counted else record)
    if test is not None:
        record = {"step": 6, "epoch": 3, "test/weights_epoch": 2, "test/loss": 0.3}
        record[f"test/{metric}"] = test
        records.append({**record, "test/correct": 80} if counted else record)
    return records


def write_metrics(folder: Path, records: list) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def run_sweep(sweep_dir: Path, jobs: list[tuple[list, str]], *overrides: str) -> None:
    """The sweep callback over `jobs` (each: its metrics.jsonl records and status), with the
    config Hydra composes for each job of a multirun (the keys it fills in at run time set here)."""
    callback = SweepSummary()
    for num, (records, status) in enumerate(jobs):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            config = compose("config", overrides=list(overrides), return_hydra_config=True)
        config.hydra.mode, config.hydra.job.num = RunMode.MULTIRUN, num
        config.hydra.sweep.dir = str(sweep_dir)
        config.hydra.runtime.output_dir = str(sweep_dir / str(num))
        write_metrics(sweep_dir / str(num), records)
        callback.on_job_start(config)
        job = JobReturn(overrides=[f"seed={num}", *overrides], status=JobStatus[status])
        callback.on_job_end(config, job)
    callback.on_multirun_end(config)


def summary(sweep_dir: Path) -> tuple[list[str], list[dict]]:
    with (sweep_dir / "summary.csv").open() as file:
        reader = csv.DictReader(file)
        return reader.fieldnames, list(reader)


def test_a_classification_sweep_summary_keeps_its_columns_and_table(tmp_path, capsys):
    """The columns and the table as they were before tasks: test accuracy and loss, no counts."""
    run_sweep(tmp_path, [(run_records("acc", [0.5, 0.8, 0.7], 0.75), "COMPLETED"),
                         (run_records("acc", [0.6, 0.6, 0.6], None), "FAILED")])  # fmt: skip
    fields, rows = summary(tmp_path)
    assert fields == ["job", "overrides", "monitor", "best", "best_epoch", "test/acc",
                      "test/loss", "wall_s", "status", "folder"]  # fmt: skip
    assert [(r["job"], r["best"], r["test/acc"], r["test/loss"]) for r in rows] == [
        ("0", "0.8", "0.75", "0.3"),
        ("1", "0.6", "", ""),
    ]
    table = capsys.readouterr().out.splitlines()
    assert table[1] == "   best monitor  epoch test acc  wall s status    overrides"
    assert table[2].split()[:4] == ["0.8000", "val/acc", "2", "0.7500"]
    assert table[3].split()[:4] == ["0.6000", "val/acc", "1", "-"]


def test_a_failed_jobs_cause_is_told_and_kept_in_its_job_json(tmp_path, caplog):
    """Whichever job of a sweep fails (a non-finite loss, here), its sentence is logged as the
    job ends (console and its train.log) and kept in job.json; summary.csv keeps its columns."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        config = compose("config", return_hydra_config=True)
    config.hydra.mode, config.hydra.job.num = RunMode.MULTIRUN, 3
    config.hydra.sweep.dir = str(tmp_path)
    config.hydra.runtime.output_dir = str(tmp_path / "3")
    write_metrics(tmp_path / "3", run_records("acc", [0.5], None))
    callback = SweepSummary()
    callback.on_job_start(config)
    stop = "Stopped: the training loss was not finite at step 7 (NaN or infinite), ..."
    job = JobReturn(overrides=["optimizer.lr=100"], status=JobStatus.FAILED)
    job.return_value = NonFiniteLoss(stop)
    callback.on_job_end(config, job)
    assert json.loads((tmp_path / "3" / "job.json").read_text())["cause"] == stop
    assert f"Job 3 (optimizer.lr=100) stopped: {stop}" in caplog.text
    callback.on_multirun_end(config)
    assert "cause" not in summary(tmp_path)[0]


def test_a_regression_sweep_summary_carries_the_test_mae(tmp_path, capsys):
    """checkpoint.monitor=val/mae, mode=min: the best (lowest) first, with its test/mae."""
    jobs = [(run_records("mae", [0.4, 0.3, 0.35], 0.32), "COMPLETED"),
            (run_records("mae", [0.2, 0.25, 0.3], 0.22), "COMPLETED")]  # fmt: skip
    run_sweep(tmp_path, jobs, "checkpoint.monitor=val/mae", "checkpoint.mode=min")
    fields, rows = summary(tmp_path)
    assert fields == ["job", "overrides", "monitor", "best", "best_epoch", "test/mae",
                      "test/loss", "wall_s", "status", "folder"]  # fmt: skip
    assert [(r["job"], r["monitor"], r["best"], r["test/mae"]) for r in rows] == [
        ("1", "val/mae", "0.2", "0.22"),
        ("0", "val/mae", "0.3", "0.32"),
    ]
    assert "test/acc" not in json.loads((tmp_path / "0" / "job.json").read_text())
    table = capsys.readouterr().out.splitlines()
    assert "test mae" in table[1] and "test acc" not in table[1]
    assert table[2].split()[:4] == ["0.2000", "val/mae", "1", "0.2200"]


def test_a_summary_of_jobs_of_two_tasks_holds_the_test_metrics_of_both(tmp_path):
    """csv's columns are the union of the jobs' test metrics (a sweep over task=...)."""
    for num, metric in enumerate(["acc", "mae"]):
        (tmp_path / str(num)).mkdir()
        record = {"job": num, "overrides": "", "monitor": f"val/{metric}", "best": 0.5,
                  "best_epoch": 1, "mode": "max", f"test/{metric}": 0.4, "test/loss": 0.3,
                  "wall_s": 1.0, "status": "completed", "folder": ""}  # fmt: skip
        (tmp_path / str(num) / "job.json").write_text(json.dumps(record))
    _write(tmp_path)
    fields, rows = summary(tmp_path)
    assert fields[5:8] == ["test/acc", "test/mae", "test/loss"]
    assert [(r["test/acc"], r["test/mae"]) for r in rows] == [("0.4", ""), ("", "0.4")]


def panels(records: list) -> list[tuple[str, str, list]]:
    """The panels of curves.png for `records`: each one's title and y label, and the points of
    each of its lines."""
    import matplotlib.pyplot as plt

    figure = plots.curves_figure(records)
    found = [
        (axes.get_title(), axes.get_ylabel(), [line.get_xydata().tolist() for line in axes.lines])
        for axes in figure.axes
    ]
    plt.close(figure)
    return found


def test_curves_of_a_regression_plot_the_loss_and_the_mae(tmp_path):
    loss, mae = panels(run_records("mae", [0.4, 0.3, 0.35], 0.32))
    assert loss[:2] == ("Loss", "loss")
    assert loss[2][1] == [[2.0, 0.5], [4.0, 0.25], [6.0, 0.5 / 3]]  # val/loss at its steps
    assert mae == ("Mean absolute error", "mean absolute error",
                   [[[1.0, 0.4], [2.0, 0.3], [3.0, 0.35]], [[2.0, 0.32]]])  # fmt: skip
    path = plots.save(
        plots.curves_figure(run_records("mae", [0.4, 0.3, 0.35], 0.32)), tmp_path / "curves.png"
    )
    assert Image.open(path).size == (1000, 400)


def test_curves_of_a_classification_leave_its_count_out(tmp_path):
    found = panels(run_records("acc", [0.5, 0.8, 0.7], 0.75))
    assert [(title, ylabel) for title, ylabel, _ in found] == [
        ("Loss", "loss"),
        ("Accuracy", "accuracy"),
    ]
    assert found[1][2] == [[[1.0, 0.5], [2.0, 0.8], [3.0, 0.7]], [[2.0, 0.75]]]


@pytest.mark.parametrize("test", [0.32, None])
def test_curves_without_a_validation_still_plot_the_loss(tmp_path, test, caplog):
    """data.val_size=0: the training loss; and the test, if the run got to it."""
    records = run_records("mae", [0.4, 0.3, 0.35], test, val=False)
    found = panels(records)
    trained = [[r["step"], r["train/loss"]] for r in records if "train/loss" in r]
    assert found[0] == ("Loss", "loss", [trained, []]) and len(trained) == 6
    assert found[1:] == ([("Mean absolute error", "mean absolute error", [[], [[2.0, 0.32]]])]
                         if test else [])  # fmt: skip
    # No "val" in the legends: the series without points are left out of them; an evaluation
    # (train=false) without a validation split has a Loss panel with no legend, and no warning.
    tested = [r for r in records if "test/loss" in r]
    with caplog.at_level(logging.WARNING, logger="matplotlib"):
        evaluated = plots.curves_figure(tested)
    assert evaluated.axes[0].get_legend() is None and not caplog.records, caplog.text
    figure = plots.curves_figure(records)
    legends = [[text.get_text() for text in axes.get_legend().get_texts()] for axes in figure.axes]
    assert legends == [["train"], *([["test (weights of that epoch)"]] if test else [])], legends
    path = plots.save(figure, tmp_path / "curves.png")
    assert Image.open(path).size == ((1000 if test else 500), 400)


@pytest.fixture(scope="module")
def data(tiny_data):
    data = instantiate(compose_config(f"data.root={tiny_data}", f"data.val_size={VAL_SIZE}").data)
    data.setup(Process())
    return data


MODEL = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def test_predictions_are_the_tasks_captions_under_the_images(tmp_path, data):
    shown = plots.predict(MODEL, data, Classification(), count=20)
    images, labels = data.sample("test", 20)
    with torch.inference_mode():
        outputs = MODEL(data.normalise(images))
    assert torch.equal(shown.images, images.cpu()) and shown.images.dtype == torch.uint8
    assert shown.captions == Classification().captions(outputs, labels, data.class_names)
    write_metrics(tmp_path, run_records("acc", [0.5, 0.8, 0.7], 0.75))
    assert plots.draw(tmp_path, shown) == [tmp_path / "curves.png",
                                                 tmp_path / "predictions.png"]  # fmt: skip
    assert Image.open(tmp_path / "predictions.png").size[0] == 8 * 140  # 8 columns


class Silent(Classification):
    """A task with captions that has none for its targets (as per-pixel classes)."""

    def captions(self, outputs, targets, class_names):
        return None


def test_nothing_is_predicted_for_a_task_or_data_without_captions(tmp_path, data, monkeypatch):
    """Regression writes no captions, Silent none for these targets; data that are not images
    get none. Then draw writes curves.png alone."""
    assert plots.predict(MODEL, data, Regression()) is None
    assert plots.predict(MODEL, data, Silent()) is None
    monkeypatch.setattr(data, "is_image", False, raising=False)
    assert plots.predict(MODEL, data, Classification()) is None
    write_metrics(tmp_path, run_records("mae", [0.4, 0.3, 0.35], 0.32))
    assert plots.draw(tmp_path, None) == [tmp_path / "curves.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]
