"""Pictures of a finished run, drawn by the main process: `curves.png` (the metrics over the run)
and `predictions.png` (test images with the model's labels). matplotlib is imported only here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from src import storage
from src.data import Data


class Predicted(NamedTuple):
    """Test images (uint8, on the CPU), the model's labels for them, and the true ones."""

    images: torch.Tensor
    guesses: list[int]
    labels: list[int]


@torch.inference_mode()
def predict(model: nn.Module, data: Data, count: int = 32) -> Predicted:
    """The model's labels for `count` test images spread over the split (an image folder lists
    its classes one after another)."""
    model.eval()
    images, labels = data.sample("test", count)
    guesses = model(data.normalise(images)).argmax(dim=1)
    return Predicted(images.cpu(), guesses.tolist(), labels.tolist())


def draw(run_dir: Path, shown: Predicted, data: Data) -> list[Path]:
    """Write both pictures into `run_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [curves(records, run_dir / "curves.png"), predictions(shown, data, run_dir)]


def curves(records: list[dict[str, Any]], path: Path) -> Path:
    """Training loss per step; validation loss and accuracy per epoch; the test, once, as a star
    at the epoch whose weights it tested."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "val/acc" in r]
    tests = [r for r in records if "test/acc" in r][-1:]
    figure, (loss_axes, acc_axes) = plt.subplots(1, 2, figsize=(10, 4))
    loss_axes.plot([r["step"] for r in steps], [r["train/loss"] for r in steps], label="train")
    loss_axes.plot([r["step"] for r in evals], [r["val/loss"] for r in evals], "o-", label="val")
    loss_axes.set(xlabel="optimizer step", ylabel="cross-entropy loss", title="Loss")
    loss_axes.legend()
    acc_axes.plot([r["epoch"] for r in evals], [r["val/acc"] for r in evals], "o-", label="val")
    acc_axes.plot([r["test/weights_epoch"] for r in tests], [r["test/acc"] for r in tests], "*",
                  markersize=12, label="test (weights of that epoch)")  # fmt: skip
    acc_axes.set(xlabel="epoch", ylabel="accuracy", title="Accuracy")
    acc_axes.legend()
    acc_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.tight_layout()
    storage.write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))
    plt.close(figure)
    return path


def predictions(shown: Predicted, data: Data, run_dir: Path) -> Path:
    """The `shown` test images, each labelled with the predicted and the true label; the wrong
    ones in red. One image of them all, not one plot each: a second faster to draw."""
    import matplotlib.pyplot as plt

    names = data.class_names or [str(i) for i in range(data.num_classes)]
    images = shown.images.permute(0, 2, 3, 1)  # N×H×W×C, as images are drawn
    columns, (height, width, channels) = 8, images.shape[1:]
    rows, band = -(-len(images) // columns), height // 2  # under each image: its label
    sheet = torch.full(
        (rows * (height + band), columns * (width + 4), channels), 255, dtype=torch.uint8
    )
    figure = plt.figure(figsize=(columns * 1.4, columns * 1.4 * sheet.shape[0] / sheet.shape[1]))
    axes = figure.add_axes((0, 0, 1, 1))
    for i, (image, guess, truth) in enumerate(
        zip(images, shown.guesses, shown.labels, strict=True)
    ):
        top, left = (i // columns) * (height + band), (i % columns) * (width + 4) + 2
        sheet[top : top + height, left : left + width] = image
        wrong = guess != truth
        label = names[guess] + (f"\n(true: {names[truth]})" if wrong else "")
        axes.text(left + width / 2, top + height + 1, label, ha="center", va="top", fontsize=7,
                  color="red" if wrong else "black")  # fmt: skip
    grey = channels == 1
    axes.imshow(sheet[..., 0] if grey else sheet, cmap="gray" if grey else None, vmin=0, vmax=255,
                interpolation="nearest")  # fmt: skip
    axes.axis("off")
    path = run_dir / "predictions.png"
    storage.write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))
    plt.close(figure)
    return path
