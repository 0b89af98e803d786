"""The benchmark runs every configuration it reports, here on tiny data; its figures are not
checked, only that each row was measured."""

import csv
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, defaults_for_tests, offline_env, readme_command


def benchmark(options: list[str], tmp_path, data, timeout: float = 600) -> list[dict]:
    """bench/run.py with `options` on `data`; the rows of its results.csv (its one output
    folder's, under tmp_path)."""
    command = [sys.executable, "bench/run.py", *options, f"--root={data}", f"--out={tmp_path}"]
    result = subprocess.run(
        command, cwd=REPO, env=offline_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (out,) = tmp_path.iterdir()
    return list(csv.DictReader((out / "results.csv").open()))


@pytest.mark.slow
def test_benchmark_of_the_gpu_recipe_runs_every_row(tmp_path, tiny_data):
    """--fast (bf16, channels-last, torch.compile, warm-up steps) for the template and the bare
    loop (under DDP: test_train's compiled warm-up). The DataLoader's rows differ from the tensor
    row by the loader alone, which the README command's rows run: each compiled row costs some
    20 s of compiling on this CPU."""
    options = ["--models=mlp", "--processes=1", "--repeats=1", "--batch-size=32",
               "--loaders", "tensor", "bare", "--fast", "--images=96"]  # fmt: skip
    rows = benchmark(options, tmp_path, tiny_data)
    (out,) = tmp_path.iterdir()
    assert [(r["processes"], r["loader"]) for r in rows] == [("1", "tensor"), ("1", "bare loop")]
    assert all(float(r["images_per_s"]) > 0 for r in rows)
    # --images=96: epochs of 3 steps of 32, in both rows alike; each row's first epoch, its
    # steady one and its whole process, the bare loop's timed the same way.
    recipe = (out / "table.md").read_text().splitlines()[0]
    said = "epochs of the first 3 steps of Fashion-MNIST (the first, then a steady one), global"
    assert f"{said} batch 32" in recipe, recipe
    assert all(float(r["train_s"]) * float(r["images_per_s"]) == pytest.approx(96) for r in rows)
    for row in rows:
        assert float(row["process_s"]) > float(row["train_s"]) and float(row["process_s"]) > 0
        assert float(row["first_images_per_s"]) > 0 and row["first_vs_bare_loop"], row
    # Each run's line, written as it finished.
    runs = list(csv.DictReader((out / "runs.csv").open()))
    assert [(r["repeat"], r["loader"], r["images_per_s"], r["process_s"]) for r in runs] == [
        ("1", r["loader"], r["images_per_s"], r["process_s"]) for r in rows
    ]
    assert (out / "images_per_s.png").stat().st_size > 0


@pytest.mark.slow
def test_the_readme_benchmark_command_runs_every_row_and_the_drift_guard_rows(tmp_path, tiny_data):
    """The README's command, on the tiny data, with one run of each row instead of its three
    (bench/README.md's `--repeats 1`: the table takes the fastest of however many) and with
    --drift-guard: its DDP rows without the guard and with it at every step, and the cost of one
    check worked out from them."""
    command = readme_command("python bench/run.py")
    options = [*command.split()[2:], "--repeats=1", "--drift-guard"]
    rows = benchmark(options, tmp_path, tiny_data, timeout=900)
    (out,) = tmp_path.iterdir()
    assert {(r["model"], r["processes"]) for r in rows} == {("mlp", "1"), ("mlp", "2")}
    workers = min(4, os.cpu_count() or 1)  # bench/run.py's default
    loaders = ["torch, 0 workers", f"torch, {workers} workers", "tensor", "bare loop"]
    guard = ["tensor, drift guard off", "tensor, drift guard every step"]
    assert [(r["processes"], r["loader"]) for r in rows] == [
        *(("1", loader) for loader in loaders),
        *(("2", loader) for loader in loaders + guard),
    ]
    assert all(float(r["images_per_s"]) > 0 for r in rows)
    assert "the fastest of 1 run(s)" in (out / "table.md").read_text()
    assert "- mlp, 2 processes: " in (out / "table.md").read_text()
    assert " ms a check; every step " in (out / "table.md").read_text()


@pytest.mark.slow
def test_memory_report_shows_fsdp_sharding_the_training_state(tmp_path, tiny_data):
    """The README's bench/memory.py, at 2 processes: DDP holds the whole of the weights,
    gradients and Adam's moments on each rank, FSDP half of them (up to uneven shards' padding)."""
    readme = readme_command("python bench/memory.py")
    command = [sys.executable, *readme.split()[1:], "--hidden=64", "--processes", "2",
               "--steps=2", f"--root={tiny_data}", f"--out={tmp_path}"]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, env=offline_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (out,) = tmp_path.iterdir()
    rows = {(r["mode"], r["processes"]): r for r in csv.DictReader((out / "results.csv").open())}
    assert list(rows) == [("none", "1"), ("ddp", "2"), ("fsdp", "2")]
    whole = float(rows["none", "1"]["state_mb"])
    # 784·64 + 64 + 64·10 + 10 parameters, 4 bytes each, as weights, gradients and 2 moments.
    assert whole == pytest.approx(4 * 4 * (784 * 64 + 64 + 64 * 10 + 10) / 2**20, rel=1e-3)
    assert float(rows["ddp", "2"]["state_mb"]) == whole
    assert 0.5 <= float(rows["fsdp", "2"]["state_mb"]) / whole < 0.51
    assert all(float(r["peak_mb"]) > 0 for r in rows.values())
    assert "| fsdp | 2 |" in (out / "table.md").read_text()


@pytest.mark.slow
def test_startup_report_times_the_three_commands(tmp_path, tiny_data):
    """bench/README.md's bench/startup.py, one round on the tiny data: each command timed, and
    debug=fast's time split between torch's imports and the template's own start-up. The figures
    themselves are not checked."""
    command = readme_command("python bench/startup.py")
    command = [sys.executable, *command.split()[1:], "--repeats=1", f"--root={tiny_data}",
               f"--out={tmp_path}", *defaults_for_tests([])]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, env=offline_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (out,) = tmp_path.iterdir()
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["command"] for r in rows] == [
        "python -c 'import torch'",
        "the same, and one optimizer built",
        "python train.py debug=fast",
    ]
    assert all(float(r["fastest_s"]) > 0 and float(r["cpu_median_s"]) > 0 for r in rows)
    assert "the template's own start-up and run" in (out / "table.md").read_text()


def test_the_checkpoint_copy_report_measures_resnet18_with_adam():
    """bench/checkpoint_copy.py (run by .ci/gpu, where the copy costs something) on this CPU:
    its JSON line, for ResNet-18's 11.2 million float32 weights and Adam's two moments of each
    (3 × 42.6 MB, and BatchNorm's statistics): about 128 MB of state."""
    result = subprocess.run(
        [sys.executable, "bench/checkpoint_copy.py", "--repeats=1"],
        cwd=REPO, env=offline_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    said, line = result.stdout.strip().splitlines()[-2:]
    figures = json.loads(line)
    assert figures["device"] == "cpu" and 125 < figures["state_mb"] < 131, figures
    # The CPU's tensors are not copied (DCP's cpu_offload keeps them): far less than the write.
    assert figures["copy_s"] < figures["save_s"], figures
    assert said.startswith("ResNet-18 with Adam on cpu: 128 MB of state"), said
