"""DDP scaling: images per second of the bare loop (bench/bare.py) on 1, 2 and 4 processes,
against ideal linear scaling, with the share of each step the gradient all-reduce costs.

    python bench/scaling.py                             # MLP (CPU: 4.5 minutes on 2 cores)
    python bench/scaling.py --model cnn --steps 20 --repeats 1    # the CNN (2.5 minutes)
    python bench/scaling.py --processes 1 2 --repeats 1 --variants-at 2 4

Prints the table, and writes results.csv, table.md and scaling.png into
bench/results/scaling-<date-time>/. Each run is bare.py, under torchrun beyond one process (gloo
on CPU, nccl on GPUs): Fashion-MNIST, global batch 64 (--batch-size), SGD lr 0.01, 5 warm-up
steps, then --steps timed steps; the table shows the fastest of --repeats runs. On CPU every
process gets one thread (torchrun's OMP_NUM_THREADS=1), so one process stands for one device and
ideal scaling is N × the 1-process figure; the "all threads" row is the one process at its best.

The all-reduce's share of a step is measured, not modelled: each DDP row's processes time the
steps a second time, from the same weights, with DDP's `noop_hook`
(torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks) registered as its communication
hook. That run does all the same compute (forward, backward, DDP's bucketing, the
optimizer) but hands each gradient bucket back without all-reducing it, so

    all-reduce share = 1 − time(no-op hook) / time(all-reduce)

is the time the step loses to communication that backward does not hide (the exposed cost, not
the all-reduce's full duration, part of which overlaps the backward). Extra rows at 2 processes
(--variants-at) change DDP's bucket_cap_mb and gradient_as_bucket_view, and accumulate gradients:
4 micro-batches per step with model.no_sync() on all but the last, once splitting the same global
batch (the template's trainer.accumulate_grad_batches: as many all-reduces per image as without)
and once stepping on 4 × the batch, each process's micro-batch as large as before (a quarter of
the all-reduces per image).

What the table teaches (measured on 2 CPU cores): with the MLP, DDP loses to one process, 2
processes training 40% as many images per second as one. Its step pays twice: the all-reduce of
the 1.6 MB gradient costs the same whatever the batch (about 60% of the step), and halving each
process's batch barely shortens a small model's step (the no-op hook's figure stays near one
process's, not twice it). Bucket settings hardly matter when the gradient fills one or two
buckets. Accumulating by splitting the same batch (the template's accumulate_grad_batches) only
adds forwards and backwards, the same all-reduces per image; keeping each micro-batch's size and
stepping on 4 × the images, one all-reduce per 256 images, about doubles DDP's throughput. The
CNN, with some 40 times the compute per image for 3 times the gradient, scales at about 90% on 2
processes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
CPU = not torch.cuda.is_available()
CORES = os.cpu_count() or 1


def configurations(processes: list[int], variants_at: list[int], batch_size: int) -> list[dict]:
    """The rows: each process count with DDP's defaults, then the variants at `variants_at`."""
    rows = [
        {"processes": n, "setting": "one process" if n == 1 else "DDP defaults", "flags": []}
        for n in processes
    ]
    if CPU and 1 in processes and CORES > 1:
        rows.insert(1, {"processes": 1, "setting": f"one process, all {CORES} threads",
                        "flags": [], "threads": CORES, "scales": False})  # fmt: skip
    for n in variants_at:
        rows += [
            {"processes": n, "setting": "bucket_cap_mb=1", "flags": ["--bucket-cap-mb=1"]},
            {"processes": n, "setting": "bucket_cap_mb=100", "flags": ["--bucket-cap-mb=100"]},
            {"processes": n, "setting": "gradient_as_bucket_view",
             "flags": ["--gradient-as-bucket-view"]},
            {"processes": n, "setting": "4 micro-batches of the batch",
             "flags": ["--accumulate=4"]},
            {"processes": n, "setting": f"4 micro-batches, step of {4 * batch_size}",
             "flags": ["--accumulate=4"], "batch": 4 * batch_size},
        ]  # fmt: skip
    for row in rows:
        row.setdefault("batch", batch_size)
        row.setdefault("threads", 1 if CPU else None)
    return rows


def measure(row: dict, args: argparse.Namespace) -> dict:
    """Run bare.py once for `row` (a DDP row: then again with the no-op hook, in the same
    processes); its JSON line."""
    launcher = [sys.executable]
    if row["processes"] > 1:
        launcher = [*TORCHRUN, f"--nproc_per_node={row['processes']}"]
    command = [
        *launcher,
        str(ROOT / "bench" / "bare.py"),
        f"--model={args.model}",
        f"--root={args.root}",
        f"--batch-size={row['batch']}",
        f"--steps={args.steps}",
        "--warmup-steps=5",  # DDP rebuilds its buckets after the first step; gloo connects
        *row["flags"],
        *(["--also-no-communication"] if row["processes"] > 1 else []),
    ]
    env = dict(os.environ)
    if row["threads"]:
        env["OMP_NUM_THREADS"] = str(row["threads"])
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument(
        "--root",
        default="/usr/share/datasets/fashion-mnist",
        help="folder with the Fashion-MNIST IDX files",
    )
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--variants-at",
        type=int,
        nargs="*",
        default=[2],
        help="process counts of the bucket and accumulation rows (none: no such rows)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each row, taken in turn; the table shows the fastest",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if not CPU and max(args.processes) > torch.cuda.device_count():
        sys.exit(f"{max(args.processes)} processes need as many GPUs; this machine has "
                 f"{torch.cuda.device_count()}. Pass fewer with --processes.")  # fmt: skip

    out = args.out / datetime.now().strftime("scaling-%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True)
    rows = configurations(args.processes, args.variants_at, args.batch_size)
    # In turn, so that a machine slowing down or speeding up touches every row alike.
    for repeat in range(1, args.repeats + 1):
        for row in rows:
            run = measure(row, args)
            speeds = [run[key] for key in ("time/images_per_s", "noop/images_per_s") if key in run]
            row.setdefault("all-reduce", []).append(speeds[0])
            row.setdefault("no-op hook", []).extend(speeds[1:])
            print(
                f"run {repeat}/{args.repeats}: {row['processes']} process(es) "
                f"{row['setting']:32} " + " ".join(f"{v:8,.0f}" for v in speeds) + " images/s",
                flush=True,
            )
    summarise(rows)
    fields = ["model", "processes", "setting", "threads", "step_images", "images_per_s", "slowest",
              "ideal", "efficiency", "noop_images_per_s", "communication_share"]  # fmt: skip
    with (out / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**row, "model": args.model} for row in rows)
    table = f"{header(args)}\n\n{markdown(rows)}\n{notes(args)}"
    (out / "table.md").write_text(table)
    plot(rows, out / "scaling.png", args.model)
    print(f"\n{table}\nWritten to {out}")


def summarise(rows: list[dict]) -> None:
    """The fastest run of each row against ideal scaling; the all-reduce's share of its step."""
    base = next((r for r in rows if r["setting"] == "one process"), None)
    for row in rows:
        # The fastest run, as timeit advises: a slower one measures what else the machine was
        # doing, not the code.
        row["images_per_s"], row["slowest"] = max(row["all-reduce"]), min(row["all-reduce"])
        row["step_images"] = row["batch"]
        ideal = base and row.get("scales", True)  # not the all-threads row
        row["ideal"] = row["processes"] * base["images_per_s"] if ideal else None
        row["efficiency"] = row["images_per_s"] / row["ideal"] if ideal else None
        noop = max(row["no-op hook"], default=None)
        row["noop_images_per_s"] = noop
        # Time per image is 1 / images per second: 1 − t(no-op) / t(all-reduce).
        row["communication_share"] = 1 - row["images_per_s"] / noop if noop else None


def header(args: argparse.Namespace) -> str:
    device = "CPU, gloo" if CPU else f"{torch.cuda.get_device_name()}, nccl"
    return (
        f"{device}; os.cpu_count() = {CORES}; torch {torch.__version__}. {args.model.upper()}, "
        f"Fashion-MNIST, global batch {args.batch_size}, SGD lr 0.01; bench/bare.py, "
        f"{args.steps} timed steps after 5 warm-up steps; the fastest of {args.repeats} run(s)."
    )


def markdown(rows: list[dict]) -> str:
    def cell(value: float | None, form: str) -> str:
        return "–" if value is None else format(value, form)

    lines = [
        "| processes | setting | images per step | images/s | slowest run | ideal (N × 1) | "
        "efficiency | images/s, no-op hook | all-reduce share |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['processes']} | {r['setting']} | {r['step_images']} | {r['images_per_s']:,.0f} | "
        f"{r['slowest']:,.0f} | {cell(r['ideal'], ',.0f')} | {cell(r['efficiency'], '.0%')} | "
        f"{cell(r['noop_images_per_s'], ',.0f')} | {cell(r['communication_share'], '.0%')} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def notes(args: argparse.Namespace) -> str:
    lines = [
        "- ideal (N × 1): N times the one-process row; efficiency = images/s / ideal.",
        "- all-reduce share = 1 − time(no-op hook) / time(all-reduce): the same DDP step run a "
        "second time with a communication hook that skips the all-reduce. Noise between the two "
        "runs can make a small share negative.",
        "- images per step: the images of one optimizer step, so of one gradient all-reduce.",
    ]
    if CPU:
        lines.append(
            "- CPU: every process has one thread (OMP_NUM_THREADS=1, as torchrun sets it for "
            "several processes), so one process stands for one device; the 'all threads' row is "
            "what one process does with every core."
        )
    if CPU and max(args.processes) > CORES:
        lines.append(
            f"- {max(args.processes)} processes on {CORES} cores oversubscribe them: the processes "
            "take turns on the cores, so those rows cannot reach ideal scaling here and their "
            "no-op runs mostly measure the contention."
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, model: str) -> None:
    import matplotlib  # only the benchmark draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 0.35 * len(rows) + 2.5))
    main = [r for r in rows if r["setting"] in ("one process", "DDP defaults")]
    counts = [r["processes"] for r in main]
    left.plot(counts, [r["images_per_s"] for r in main], "o-", label="DDP (all-reduce)")
    ddp = [r for r in main if r["noop_images_per_s"]]
    if ddp:
        left.plot([r["processes"] for r in ddp], [r["noop_images_per_s"] for r in ddp], "s--",
                  label="no-op hook (compute only)")  # fmt: skip
    if main[0]["ideal"]:
        left.plot(counts, [r["ideal"] for r in main], ":", color="grey", label="ideal (N × 1)")
    left.set(xlabel="processes", ylabel="training images per second", xticks=counts,
             title=f"{model.upper()}, DDP defaults")  # fmt: skip
    left.legend()
    labels = [f"{r['processes']} proc, {r['setting']}" for r in rows][::-1]
    right.barh(labels, [r["noop_images_per_s"] or 0 for r in rows][::-1], color="tab:grey",
               alpha=0.4, label="no-op hook (compute only)")  # fmt: skip
    right.barh(labels, [r["images_per_s"] for r in rows][::-1], color="tab:blue", label="measured")
    right.set(xlabel="training images per second", title="every row")
    right.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
