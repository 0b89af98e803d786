"""Training speed side by side, measured in one run: images per second of Fashion-MNIST for each
configuration of the template, in its first epoch and in a steady one (the second), and the whole
process's seconds; and the same for a bare hand-written loop over the same tensors (bench/bare.py,
timed the same way), the ceiling the template's own overhead is measured against.

    python bench/run.py                        # everything (CPU: about 15 minutes on 2 cores)
    python bench/run.py --models mlp           # the MLP rows only
    python bench/run.py --repeats 1            # one run of each instead of the fastest of three
    python bench/run.py --images 12800         # epochs of the first 12,800 images, not 60,000
    python bench/run.py --models cnn --batch-size 1024 --fast   # the GPU recipe
    python bench/run.py --processes 2 --loaders tensor --accumulate 1 4   # 4 micro-batches a step
    python bench/run.py --image-folder data/fashion-png --loaders torch tensor   # PNG files
    python bench/run.py --models mlp --processes 2 --loaders tensor --drift-guard   # its cost

Prints the table, and writes results.csv, table.md and images_per_s.png into
bench/results/<date-time>/, and runs.csv there as each run finishes (a run stopped midway keeps
the rows that finished). Recipe: global batch 64 (--batch-size), SGD lr 0.01, two epochs;
`loader` is data.loader (torch = DataLoader). --fast adds bfloat16, channels-last and
torch.compile with CUDA graphs, and 5 warm-up steps before the clock starts, to every row.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# --fast, the GPU recipe: bfloat16 autocast, channels-last, torch.compile with CUDA graphs, and
# warm-up steps so that compilation stays out of the epoch's time. The same for the bare loop.
FAST_OVERRIDES = [
    "trainer.precision=bf16",
    "trainer.channels_last=true",
    "trainer.compile=reduce-overhead",
    "trainer.warmup_steps=5",
]
FAST_FLAGS = ["--precision", "bf16", "--channels-last", "--compile", "reduce-overhead",
              "--warmup-steps", "5"]  # fmt: skip


def configurations(
    models: list[str],
    processes: list[int],
    workers: int,
    loaders: list[str],
    accumulate: list[int],
    drift_guard: bool = False,
) -> list[dict]:
    """The rows: each model and process count with each loader (`torch` is a DataLoader with 0
    and with `workers` workers; `tensor` the in-memory path, once per `accumulate` value; with
    `drift_guard`, under DDP also without the drift guard and with it checking every step)."""
    best = [
        "data.loader=torch",
        f"data.num_workers={workers}",
        "data.persistent_workers=true",
        "data.pin_memory=true",
    ]
    variants = []
    if "torch" in loaders:
        variants += [
            ("torch, 0 workers", ["data.loader=torch", "data.num_workers=0"]),
            (f"torch, {workers} workers", best),
        ]
    if "tensor" in loaders:
        variants += [
            (
                "tensor" if k == 1 else f"tensor, {k} micro-batches",
                ["data.loader=tensor", f"trainer.accumulate_grad_batches={k}"],
            )
            for k in accumulate
        ]
    guard = [
        ("tensor, drift guard off", ["parallel.check_sync_every_n_steps=null"]),
        ("tensor, drift guard every step", ["parallel.check_sync_every_n_steps=1"]),
    ]
    if "bare" in loaders:
        variants.append(("bare loop", []))
    return [
        {"model": model, "processes": nproc, "loader": loader, "extra": extra}
        for model in models
        for nproc in processes
        for loader, extra in variants + (guard if drift_guard and nproc > 1 else [])
    ]


def measure(row: dict, args: argparse.Namespace, folder: Path) -> dict:
    """Run one configuration; its epoch's timing line from metrics.jsonl (or bare.py's output)."""
    launcher = [sys.executable]
    if row["processes"] > 1:
        launcher = [*TORCHRUN, f"--nproc_per_node={row['processes']}"]
    if row["loader"] == "bare loop":
        command = [
            *launcher,
            str(ROOT / "bench" / "bare.py"),
            f"--model={row['model']}",
            f"--root={args.root}",
            f"--batch-size={args.batch_size}",
            *(FAST_FLAGS if args.fast else []),
            "--epochs=2",
            *([f"--steps={steps(args)}"] if args.images else []),
        ]
    else:
        name = f"{row['model']}-{row['processes']}-{row['loader']}"
        run_dir = folder / "".join(c if c.isalnum() else "-" for c in name)
        command = [
            *launcher,
            str(ROOT / "train.py"),
            f"model={row['model']}",
            *data_overrides(args),
            f"data.batch_size={args.batch_size}",
            "data.val_size=0",  # all 60,000 training images, as the bare loop trains on
            "logger=none",
            "checkpoint.save=false",
            "plots=false",
            "trainer.epochs=2",  # the first epoch, then a steady one
            f"hydra.run.dir={run_dir}",
            *row["extra"],
            *(FAST_OVERRIDES if args.fast else []),
            *([f"data.subset={steps(args) * args.batch_size}"] if args.images else []),
            *(["parallel=ddp"] if row["processes"] > 1 else []),
        ]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    process_s = time.perf_counter() - started  # from the command to its exit, all of it
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    if row["loader"] == "bare loop":
        line = json.loads(result.stdout.strip().splitlines()[-1])
        first = {k: v for k, v in line.items() if not k.startswith("steady/")}
        steady = {k.replace("steady/", "time/"): v for k, v in line.items() if "steady/" in k}
    else:  # the Speed hook's line of each epoch in metrics.jsonl
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        first, steady = [line for line in lines if "time/images_per_s" in line]
    return {
        **steady,  # what the rows are ranked and compared by
        "first/images_per_s": first["time/images_per_s"],
        "memory/peak_rss_mb": max(first["memory/peak_rss_mb"], steady.get("memory/peak_rss_mb", 0)),
        "process_s": process_s,
    }


def steps(args: argparse.Namespace) -> int:
    """--images as optimizer steps: the epoch's first global batches that hold them."""
    return math.ceil(args.images / args.batch_size)


def data_overrides(args: argparse.Namespace) -> list[str]:
    """Fashion-MNIST's IDX files, or (--image-folder) the same images as a folder of PNG files."""
    if args.image_folder:
        # The training set's own mean and std, as given for the IDX files: not computed per run.
        return ["data=image_folder", f"data.root={args.image_folder}", "data.in_channels=1",
                "data.mean=[0.2860]", "data.std=[0.3530]"]  # fmt: skip
    return ["data=fashion_mnist", f"data.root={args.root}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        default="/usr/share/datasets/fashion-mnist",
        help="folder with the Fashion-MNIST IDX files",
    )
    parser.add_argument(
        "--image-folder",
        type=Path,
        help="read this image folder (bench/write_image_folder.py) instead of the IDX files",
    )
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="num_workers of the best DataLoader setting",
    )
    parser.add_argument(
        "--processes",
        type=int,
        nargs="+",
        default=[1, 2] if torch.cuda.device_count() != 1 else [1],
        help="process counts (parallel=ddp beyond 1); default 1 and 2, or 1 on a single GPU",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument(
        "--images",
        type=int,
        help="train epochs of N images (N / batch steps, rounded up), not of all 60,000",
    )
    parser.add_argument(
        "--loaders",
        nargs="+",
        default=["torch", "tensor", "bare"],
        choices=["torch", "tensor", "bare"],
        help="which rows: the DataLoader (torch), the in-memory tensors, the bare loop",
    )
    parser.add_argument(
        "--accumulate",
        type=int,
        nargs="+",
        default=[1],
        help="trainer.accumulate_grad_batches values of the tensor rows (e.g. 1 4)",
    )
    parser.add_argument(
        "--drift-guard",
        action="store_true",
        help="DDP rows also without the drift guard and with it every step: what the default "
        "(before each validation and save) costs",
    )
    parser.add_argument(
        "--fast", action="store_true", help="the GPU recipe: " + " ".join(FAST_OVERRIDES)
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each configuration, taken in turn; the table shows the fastest",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    out = args.out / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True)
    rows = configurations(
        args.models, args.processes, args.workers, args.loaders, args.accumulate, args.drift_guard
    )
    measured = ["repeat", "model", "processes", "loader", "first_images_per_s", "images_per_s",
                "train_s", "process_s", "peak_rss_mb"]  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch, (out / "runs.csv").open("w") as runs:
        written = csv.writer(runs)
        written.writerow(measured)
        # In turn, so that a machine slowing down or speeding up touches every row alike.
        for repeat in range(1, args.repeats + 1):
            for row in rows:
                timing = measure(row, args, Path(scratch) / f"repeat{repeat}")  # new folders
                row.setdefault("runs", []).append(timing)
                print(
                    f"run {repeat}/{args.repeats}: {row['model']:4} {row['processes']} "
                    f"process(es) {row['loader']:18} first epoch "
                    f"{timing['first/images_per_s']:9,.0f} images/s, steady "
                    f"{timing['time/images_per_s']:9,.0f}, {timing['process_s']:5.1f} s in all",
                    flush=True,
                )
                values = ("first/images_per_s", "time/images_per_s", "time/train_s", "process_s",
                          "memory/peak_rss_mb")  # fmt: skip
                found = [timing[key] for key in values]
                written.writerow([repeat, row["model"], row["processes"], row["loader"], *found])
                runs.flush()  # kept should the benchmark be stopped
    for row in rows:
        # The fastest run, as timeit advises: a slower one measures what else the machine was
        # doing (a shared machine slows under sustained load), not the code.
        runs = sorted(row["runs"], key=lambda timing: timing["time/images_per_s"])
        row["images_per_s"], row["slowest"] = (runs[i]["time/images_per_s"] for i in (-1, 0))
        row["train_s"] = runs[-1]["time/train_s"]
        row["first_images_per_s"] = max(timing["first/images_per_s"] for timing in runs)
        row["process_s"] = min(timing["process_s"] for timing in runs)
        row["peak_rss_mb"] = max(timing["memory/peak_rss_mb"] for timing in runs)
        row["peak_cuda_mb"] = max((t.get("memory/peak_cuda_mb", 0) for t in runs), default=0) or ""
    for row in rows:  # each against the bare loop of its model and processes, if measured
        bare = [
            r
            for r in rows
            if r["loader"] == "bare loop"
            and (r["model"], r["processes"]) == (row["model"], row["processes"])
        ]
        row["vs_bare_loop"] = row["images_per_s"] / bare[0]["images_per_s"] if bare else None
        first = bare and row["first_images_per_s"] / bare[0]["first_images_per_s"]
        row["first_vs_bare_loop"] = first or None
    fields = [
        "model",
        "processes",
        "loader",
        "first_images_per_s",
        "first_vs_bare_loop",
        "images_per_s",
        "slowest",
        "vs_bare_loop",
        "train_s",
        "process_s",
        "peak_rss_mb",
        "peak_cuda_mb",
    ]
    with (out / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    recipe = (
        f"{device}, {os.cpu_count()} cores; "
        + (f"epochs of the first {steps(args)} steps" if args.images else "epochs")
        + " of Fashion-MNIST (the first, then a steady one), global batch "
        f"{args.batch_size}, SGD lr 0.01"
        + (", " + " ".join(FAST_OVERRIDES) if args.fast else "")
        + f"; the fastest of {args.repeats} run(s)"
    )
    table = f"{recipe}\n\n{markdown(rows)}{drift_guard_cost(rows, args.batch_size)}"
    (out / "table.md").write_text(table)
    plot(rows, out / "images_per_s.png")
    print(f"\n{table}\nWritten to {out}")


def markdown(rows: list[dict]) -> str:
    """The table: images/s of the first epoch and of the steady (second) one, each against the
    bare loop's same epoch, the slowest run's steady epoch, and the whole process's seconds."""
    lines = [
        "| model | processes | loader | first epoch (images/s) | vs bare loop | steady epoch "
        "(images/s) | slowest run | vs bare loop | whole process (s) | peak RSS (MB) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['model']} | {r['processes']} | {r['loader']} | {r['first_images_per_s']:,.0f} | "
        f"{ratio(r['first_vs_bare_loop'])} | {r['images_per_s']:,.0f} | {r['slowest']:,.0f} | "
        f"{ratio(r['vs_bare_loop'])} | {r['process_s']:.1f} | {r['peak_rss_mb']:,.0f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def drift_guard_cost(rows: list[dict], batch_size: int) -> str:
    """The drift guard's cost, from the rows without it and with it at every step: the time of
    one check, and the share of an epoch the default's one check (before the epoch's validation,
    outside its timed steps; one more at each checkpoint.every_n_steps save) takes."""
    lines = []
    for model, nproc in sorted({(r["model"], r["processes"]) for r in rows}):
        by = {r["loader"]: r for r in rows if (r["model"], r["processes"]) == (model, nproc)}
        off, every = by.get("tensor, drift guard off"), by.get("tensor, drift guard every step")
        if not (off and every):
            continue
        steps = math.ceil(round(off["train_s"] * off["images_per_s"]) / batch_size)
        per_check = max(every["train_s"] - off["train_s"], 0) / steps
        lines.append(
            f"- {model}, {nproc} processes: {per_check * 1000:.2f} ms a check; every step "
            f"{every['train_s'] / off['train_s'] - 1:+.1%} of the epoch's time, the default's one "
            f"check an epoch {per_check / off['train_s']:.3%}"
        )
    return "\nDrift guard:\n" + "\n".join(lines) + "\n" if lines else ""


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # only the benchmark draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}, {r['processes']} proc, {r['loader']}" for r in rows]
    figure, axes = plt.subplots(figsize=(8, 0.35 * len(rows) + 1))
    colours = ["tab:grey" if r["loader"] == "bare loop" else "tab:blue" for r in rows]
    axes.barh(labels[::-1], [r["images_per_s"] for r in rows][::-1], color=colours[::-1])
    axes.set_xlabel("training images per second (a steady epoch of Fashion-MNIST)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
