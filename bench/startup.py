"""Start-up: what a short run costs before and around its few steps, measured side by side.

    python bench/startup.py                 # 5 rounds of three commands (about 1.5 minutes)

Times three commands as whole processes, one after another in each of --repeats rounds (so a
machine's drift touches all three alike), and reports each one's fastest and median wall time and
its median CPU time; the differences are worked out from the fastest runs, as `timeit` advises
(a slower run measures what else the machine was doing):

- `import torch`: what every PyTorch script pays;
- `import torch` and one optimizer built: torch.optim's first parameter group imports
  torch._dynamo (`_disable_dynamo` in torch/_compile.py), which every training script pays too;
- `python train.py debug=fast` on Fashion-MNIST: Hydra's composition, the data read, 5 steps,
  one validation and the test, no logger, no checkpoint, no pictures.

The run against the second line is the template's own start-up. Prints the table, and writes
results.csv and table.md into bench/results/startup-<date-time>/. Any further arguments are
overrides for the train.py run.
"""

from __future__ import annotations

import argparse
import csv
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OPTIMIZER = "import torch; torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)"


def timed(command: list[str]) -> tuple[float, float]:
    """One run of `command`, which must succeed: its wall and CPU (user + system) seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/usr/share/datasets/fashion-mnist",
                        help="folder with the Fashion-MNIST IDX files")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the three commands")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args, overrides = parser.parse_known_args()

    out = args.out / datetime.now().strftime("startup-%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True)
    folders = (out / f"run{n}" for n in range(1 + args.repeats))  # a new run's folder: unused
    commands = {
        "python -c 'import torch'": lambda: [sys.executable, "-c", "import torch"],
        "the same, and one optimizer built": lambda: [sys.executable, "-c", OPTIMIZER],
        "python train.py debug=fast": lambda: [
            sys.executable, "train.py", "debug=fast", "data=fashion_mnist",
            f"data.root={args.root}", f"hydra.run.dir={next(folders)}", *overrides,
        ],
    }  # fmt: skip
    times = {name: [] for name in commands}
    timed(commands["python train.py debug=fast"]())  # a warm-up: the files in the page cache
    for round_ in range(args.repeats):
        for name, command in commands.items():
            times[name].append(timed(command()))
        print(f"round {round_ + 1} of {args.repeats}", flush=True)

    rows = [
        {"command": name, "fastest_s": min(w for w, _ in runs),
         "median_s": statistics.median(w for w, _ in runs),
         "cpu_median_s": statistics.median(c for _, c in runs)}
        for name, runs in times.items()
    ]  # fmt: skip
    with (out / "results.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, ["command", "fastest_s", "median_s", "cpu_median_s"])
        writer.writeheader()
        writer.writerows(rows)
    bare, optimizer, template = (row["fastest_s"] for row in rows)
    lines = [
        f"torch {torch.__version__}, Python {sys.version.split()[0]}; {args.repeats} rounds, "
        "whole processes.",
        "",
        "| command | wall, fastest | wall, median | CPU, median |",
        "|---|---|---|---|",
        *(
            f"| {r['command']} | {r['fastest_s']:.2f} s | {r['median_s']:.2f} s "
            f"| {r['cpu_median_s']:.2f} s |"
            for r in rows
        ),
        "",
        f"debug=fast takes {template - bare:.2f} s more than `import torch`, of which the "
        f"optimizer's import of torch._dynamo is {optimizer - bare:.2f} s and the template's own "
        f"start-up and run {template - optimizer:.2f} s.",
    ]
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    print(f"\n{table}\nWritten to {out}")


if __name__ == "__main__":
    main()
