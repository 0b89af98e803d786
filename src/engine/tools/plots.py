"""Pictures of a finished run, drawn by the main process: `curves.png` (the metrics over the run)
and `predictions.png` (test images with the task's captions). matplotlib is imported only here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from src.engine import storage
from src.engine.core.context import Run
from src.engine.core.task import Task
from src.engine.data import Data
from src.engine.logger import logged, measured
from src.engine.parallel import unwrap

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WORDS = {"acc": "accuracy", "mae": "mean absolute error"}  # on an axis; any other: its name


class Predicted(NamedTuple):
    images: torch.Tensor  # test images, uint8, on the CPU
    captions: list[tuple[str, bool]]  # each one's caption, and whether it is wrong (drawn red)


@torch.inference_mode()
def predict(model: nn.Module, data: Data, task: Task, count: int = 32) -> Predicted | None:
    """`count` test images and the task's captions of the outputs; None if it has none for them."""
    if not getattr(data, "is_image", True) or not hasattr(task, "captions"):
        return None
    model.eval()
    images, targets = data.sample("test", count)
    captions = task.captions(model(data.normalise(images)), targets, data.class_names)
    return None if captions is None else Predicted(images.cpu(), captions)


def finish(run: Run, model: nn.Module, step: int, pictures: bool) -> None:
    """The run's pictures, into its folder and tracker; then every rank stops together if the
    storage refused a file of the run (none leaves the process group while another uses it)."""
    unwritten = run.logger and run.logger.fault  # metrics.jsonl, refused by the storage
    # Every rank predicts: under FSDP a forward needs them all.
    shown = predict(unwrap(model), run.data, run.task) if pictures else None
    if pictures and run.process.is_main and not unwritten:
        unwritten = storage.attempt(lambda: run.logger.log_images(draw(run.run_dir, shown)))
    kept = run.checkpointer and run.checkpointer.kept
    storage.stop_together(run.process, unwritten or None, run.run_dir, step, kept or None)


def draw(run_dir: Path, shown: Predicted | None) -> list[Path]:
    """Write curves.png into `run_dir`, and predictions.png where something is `shown`."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    figures = {"curves.png": curves_figure(records)}
    if shown is not None:
        figures["predictions.png"] = predictions(shown)
    return [save(figure, run_dir / name) for name, figure in figures.items()]


def curves_figure(records: list[dict[str, Any]]) -> Figure:
    """The loss (training's per step, validation's per epoch), then a panel for each other metric
    logged: validation's per epoch, and the test as a star at the epoch whose weights it tested."""
    from matplotlib.figure import Figure  # not pyplot's: no window, nothing to close
    from matplotlib.ticker import MaxNLocator

    evals = [r for r in records if logged(r, "val")]
    test = next((r for r in reversed(records) if logged(r, "test")), {})
    found = [*(measured(r, "val") for r in evals), measured(test, "test")]
    names = [name for name in dict.fromkeys(n for m in found for n in m) if name != "loss"]
    figure = Figure(figsize=(5 + 5 * len(names), 4), layout="tight")
    loss_axes, *metric_axes = figure.subplots(1, 1 + len(names), squeeze=False)[0]
    _plot(loss_axes, records, "step", "train/loss", label="train")
    _plot(loss_axes, evals, "step", "val/loss", "o-", label="val")
    loss_axes.set(xlabel="optimizer step", ylabel="loss", title="Loss")
    if loss_axes.get_legend_handles_labels()[0]:  # none without training or a validation split
        loss_axes.legend()
    star = {"markersize": 12, "label": "test (weights of that epoch)"}
    for name, panel in zip(names, metric_axes, strict=True):
        _plot(panel, evals, "epoch", f"val/{name}", "o-", label="val")
        _plot(panel, [test], "test/weights_epoch", f"test/{name}", "*", **star)
        word = WORDS.get(name, name)
        panel.set(xlabel="epoch", ylabel=word, title=word[:1].upper() + word[1:])
        panel.legend()
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))
    return figure


def _plot(axes: Any, records: list[dict[str, Any]], x: str, y: str, *style: str, **options) -> None:
    """`y` over `x`, of the records that hold `y`: a line even of none, so that each series keeps
    its colour, but in the legend only with points (no "val" entry without a validation split)."""
    shown = [r for r in records if y in r]
    label = options.pop("label") if shown else "_" + options.pop("label")  # "_": not in a legend
    axes.plot([r[x] for r in shown], [r[y] for r in shown], *style, label=label, **options)


def predictions(shown: Predicted) -> Figure:
    """The `shown` test images, captioned (wrong ones in red), as one image: faster than plots."""
    from matplotlib.figure import Figure

    images = shown.images.permute(0, 2, 3, 1)  # N×H×W×C, as images are drawn
    columns, (height, width, channels) = 8, images.shape[1:]
    rows = -(-len(images) // columns)
    tall, wide = height + height // 2, width + 4  # a cell: the image, its caption under it, margins
    sheet = torch.full((rows * tall, columns * wide, channels), 255, dtype=torch.uint8)
    figure = Figure(figsize=(columns * 1.4, columns * 1.4 * sheet.shape[0] / sheet.shape[1]))
    axes = figure.add_axes((0, 0, 1, 1))
    style = {"ha": "center", "va": "top", "fontsize": 7}
    for i, (image, (text, wrong)) in enumerate(zip(images, shown.captions, strict=True)):
        top, left = (i // columns) * tall, (i % columns) * wide + 2
        sheet[top : top + height, left : left + width] = image
        colour = "red" if wrong else "black"
        axes.text(left + width / 2, top + height + 1, text, color=colour, **style)
    # cmap is for one channel: matplotlib draws RGB as it is.
    axes.imshow(sheet.squeeze(-1), cmap="gray", vmin=0, vmax=255, interpolation="nearest")
    axes.axis("off")
    return figure


def save(figure: Figure, path: Path) -> Path:
    storage.write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))
    return path
