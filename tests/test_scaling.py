"""The DDP scaling report runs every row it reports, here on tiny data; its figures are not
checked, only that each row was measured."""

import csv
import os
import subprocess
import sys

import pytest
from conftest import REPO, offline_env, readme_command


@pytest.mark.slow
def test_scaling_report_measures_every_row(tmp_path, tiny_data):
    """The README's command, with one and two processes (gloo) for a few steps: the bucket and
    accumulation rows at two, each DDP row also with the no-op communication hook."""
    readme = readme_command("python bench/scaling.py")
    command = [sys.executable, *readme.split()[1:], "--processes", "1", "2", "--steps=3",
               "--repeats=1", f"--root={tiny_data}", f"--out={tmp_path}"]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, env=offline_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (out,) = tmp_path.iterdir()
    assert out.name.startswith("scaling-")
    rows = list(csv.DictReader((out / "results.csv").open()))
    cores = os.cpu_count() or 1
    ones = ["one process"] + ([f"one process, all {os.cpu_count()} threads"] if cores > 1 else [])
    twos = ["DDP defaults", "bucket_cap_mb=1", "bucket_cap_mb=100", "gradient_as_bucket_view",
            "4 micro-batches of the batch", "4 micro-batches, step of 256"]  # fmt: skip
    assert [(r["processes"], r["setting"]) for r in rows] == [
        *(("1", s) for s in ones),
        *(("2", s) for s in twos),
    ]
    assert all(float(r["images_per_s"]) > 0 for r in rows)
    ddp = [r for r in rows if r["processes"] == "2"]
    # Each DDP row ran a second time with the no-op hook; its share is a number (noise on 3 steps
    # can make it anything, so only its presence is checked), and ideal scaling is N × row one.
    assert all(float(r["noop_images_per_s"]) > 0 for r in ddp)
    assert all(r["communication_share"] and float(r["efficiency"]) > 0 for r in ddp)
    assert [r["step_images"] for r in ddp] == ["64"] * 5 + ["256"]
    table = (out / "table.md").read_text()
    assert "os.cpu_count()" in table.splitlines()[0] and "all-reduce share" in table
    assert (out / "scaling.png").stat().st_size > 0
