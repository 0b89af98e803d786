"""Pictures of a finished run, drawn by the main process: `curves.png` (the metrics over the run)
and `predictions.png` (test images with the task's captions). matplotlib is imported only here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from src.engine import storage
from src.engine.core.task import Task
from src.engine.data import Data
from src.engine.logger import logged, measured

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# How a metric's name reads on its axis; any other reads as its name.
WORDS = {"acc": "accuracy", "mae": "mean absolute error"}


class Predicted(NamedTuple):
    """Test images (uint8, on the CPU) and the task's caption of each: the text, and whether the
    model got that image wrong (drawn in red)."""

    images: torch.Tensor
    captions: list[tuple[str, bool]]


@torch.inference_mode()
def predict(model: nn.Module, data: Data, task: Task, count: int = 32) -> Predicted | None:
    """The task's captions of the model's outputs for `count` test images spread over the split
    (an image folder lists its classes one after another). None where there is nothing to draw:
    the data are not images, or the task has no captions for them."""
    if not getattr(data, "is_image", True) or not hasattr(task, "captions"):
        return None
    model.eval()
    images, targets = data.sample("test", count)
    captions = task.captions(model(data.normalise(images)), targets, data.class_names)
    return None if captions is None else Predicted(images.cpu(), captions)


def draw(run_dir: Path, shown: Predicted | None, data: Data) -> list[Path]:
    """Write curves.png into `run_dir`, and predictions.png where something is `shown`; returns
    the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pictures = [curves(records, run_dir / "curves.png")]
    return pictures if shown is None else [*pictures, predictions(shown, run_dir)]


def curves(records: list[dict[str, Any]], path: Path) -> Path:
    """Write `curves_figure` of the records (metrics.jsonl's lines) to `path`."""
    import matplotlib.pyplot as plt

    figure = curves_figure(records)
    storage.write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))
    plt.close(figure)
    return path


def curves_figure(records: list[dict[str, Any]]) -> Figure:
    """The loss: training's per step, validation's per epoch. Then a panel for each other metric
    the evaluations logged (`acc`, `mae`, ...): validation's per epoch, and the test, once, as a
    star at the epoch whose weights it tested."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r for r in records if "train/loss" in r]
    evals = [r for r in records if logged(r, "val")]
    test = next((r for r in reversed(records) if logged(r, "test")), {})
    found = [*(measured(r, "val") for r in evals), measured(test, "test")]
    names = [name for name in dict.fromkeys(n for m in found for n in m) if name != "loss"]
    panels = 1 + len(names)
    figure, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    loss_axes, *metric_axes = axes[0]
    losses = [r for r in evals if "val/loss" in r]
    loss_axes.plot([r["step"] for r in steps], [r["train/loss"] for r in steps], label="train")
    loss_axes.plot([r["step"] for r in losses], [r["val/loss"] for r in losses], "o-", label="val")
    loss_axes.set(xlabel="optimizer step", ylabel="loss", title="Loss")
    loss_axes.legend()
    for name, panel in zip(names, metric_axes, strict=True):
        vals = [r for r in evals if f"val/{name}" in r]
        tests = [test] if f"test/{name}" in test else []
        panel.plot([r["epoch"] for r in vals], [r[f"val/{name}"] for r in vals], "o-", label="val")
        panel.plot([r["test/weights_epoch"] for r in tests], [r[f"test/{name}"] for r in tests],
                   "*", markersize=12, label="test (weights of that epoch)")  # fmt: skip
        word = WORDS.get(name, name)
        panel.set(xlabel="epoch", ylabel=word, title=word[:1].upper() + word[1:])
        panel.legend()
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    return figure


def predictions(shown: Predicted, run_dir: Path) -> Path:
    """The `shown` test images, each with its caption under it; the wrong ones in red. One image
    of them all, not one plot each: a second faster to draw."""
    import matplotlib.pyplot as plt

    images = shown.images.permute(0, 2, 3, 1)  # N×H×W×C, as images are drawn
    columns, (height, width, channels) = 8, images.shape[1:]
    rows, band = -(-len(images) // columns), height // 2  # under each image: its caption
    sheet = torch.full(
        (rows * (height + band), columns * (width + 4), channels), 255, dtype=torch.uint8
    )
    figure = plt.figure(figsize=(columns * 1.4, columns * 1.4 * sheet.shape[0] / sheet.shape[1]))
    axes = figure.add_axes((0, 0, 1, 1))
    for i, (image, (text, wrong)) in enumerate(zip(images, shown.captions, strict=True)):
        top, left = (i // columns) * (height + band), (i % columns) * (width + 4) + 2
        sheet[top : top + height, left : left + width] = image
        axes.text(left + width / 2, top + height + 1, text, ha="center", va="top", fontsize=7,
                  color="red" if wrong else "black")  # fmt: skip
    grey = channels == 1
    axes.imshow(sheet[..., 0] if grey else sheet, cmap="gray" if grey else None, vmin=0, vmax=255,
                interpolation="nearest")  # fmt: skip
    axes.axis("off")
    path = run_dir / "predictions.png"
    storage.write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))
    plt.close(figure)
    return path
