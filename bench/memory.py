"""Memory per rank under none, ddp and fsdp: what FSDP's sharding saves, measured in the template.

    python bench/memory.py                       # MLP 784-16384-10, Adam (CPU: about 1.5 minutes)
    python bench/memory.py --hidden 4096 --processes 2

Each row is one real `python train.py` run (self-launched under ddp and fsdp: gloo on CPU, nccl
on GPUs) of --steps Adam steps on Fashion-MNIST, read back from its metrics.jsonl. Two figures
per row, both rank 0's:

- weights + gradients + optimizer state: the tensors' own sizes after a step
  (`memory/state_mb`, which every run logs), whole in one process and under DDP, 1/N under FSDP;
- peak memory: the process's peak RSS on CPU, peak CUDA memory on GPUs. It also counts what the
  tensors' sizes do not: PyTorch itself, the data, activations, DDP's gradient buckets and
  FSDP's gathered units.

Prints the table, and writes results.csv and table.md into bench/results/memory-<date-time>/.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available()


def measure(mode: str, processes: int, args: argparse.Namespace, out: Path) -> dict:
    """One train.py run; rank 0's memory figures from its metrics.jsonl."""
    run_dir = out / f"{mode}-{processes}"
    command = [
        sys.executable,
        "train.py",
        "model=mlp",
        f"model.hidden={args.hidden}",
        "optimizer=adam",
        "data=fashion_mnist",
        f"data.root={args.root}",
        f"data.subset={args.steps * 64}",
        "data.batch_size=64",
        "data.val_size=0",
        f"trainer.max_steps={args.steps}",
        "trainer.test_weights=last",
        "checkpoint.save=false",
        "plots=false",
        "logger=none",
        f"parallel={mode}",
        f"hydra.run.dir={run_dir}",
    ]
    if mode != "none":
        command.append(f"parallel.nproc_per_node={processes}")
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (speed,) = [line for line in lines if "memory/state_mb" in line]
    peak = speed.get("memory/peak_cuda_mb", speed["memory/peak_rss_mb"])
    return {"mode": mode, "processes": processes, "state_mb": speed["memory/state_mb"],
            "peak_mb": peak}  # fmt: skip


def markdown(rows: list[dict]) -> str:
    whole = rows[0]["state_mb"]
    peak = "peak CUDA memory" if GPU else "peak RSS"
    lines = [
        f"| parallel | processes | weights + gradients + Adam state per rank | of one process's "
        f"| {peak}, rank 0 |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['processes']} | {row['state_mb']:,.1f} MB "
            f"| {row['state_mb'] / whole:.2f} | {row['peak_mb']:,.0f} MB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        default="/usr/share/datasets/fashion-mnist",
        help="folder with the Fashion-MNIST IDX files",
    )
    parser.add_argument("--hidden", type=int, default=16384, help="the MLP's hidden width")
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3, help="Adam steps per run")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if GPU and max(args.processes) > torch.cuda.device_count():
        sys.exit(f"{max(args.processes)} processes need as many GPUs; this machine has "
                 f"{torch.cuda.device_count()}. Pass fewer with --processes.")  # fmt: skip

    out = args.out / datetime.now().strftime("memory-%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True)
    runs = [("none", 1)] + [(m, n) for m in ("ddp", "fsdp") for n in args.processes]
    rows = []
    for mode, processes in runs:
        rows.append(measure(mode, processes, args, out))
        print(f"{mode:4} {processes} process(es): {rows[-1]['state_mb']:,.1f} MB", flush=True)
    with (out / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, ["mode", "processes", "state_mb", "peak_mb"])
        writer.writeheader()
        writer.writerows(rows)
    device = torch.cuda.get_device_name() if GPU else "CPU"
    header = (
        f"{device}; torch {torch.__version__}. MLP 784-{args.hidden}-10, Adam, Fashion-MNIST, "
        f"global batch 64, {args.steps} steps."
    )
    table = f"{header}\n\n{markdown(rows)}\n"
    (out / "table.md").write_text(table)
    print(f"\n{table}\nWritten to {out}")


if __name__ == "__main__":
    main()
