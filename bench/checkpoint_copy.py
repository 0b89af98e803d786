"""What a save pays to hold a checkpoint's tensors on the CPU: ResNet-18 with Adam's state, on the
best device there is, its state copied as `src/engine/checkpoint.py`'s parts copy it at each save
(torch.distributed.checkpoint's state dicts, offloaded to the CPU: a GPU run's checkpoint loads
where no GPU is), beside writing that state to disk as a save writes it
(`storage.write_atomically`: a partial file, flushed to the disk, renamed).

    python bench/checkpoint_copy.py

Prints the seconds of each (the median of --repeats) and the state's size, as one JSON line last.
On a CPU the copy costs nothing (the tensors are already there): the figure is a GPU's.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the engine, from any folder

from src.engine.checkpoint import OptimizerState, Weights  # noqa: E402
from src.engine.storage import write_atomically  # noqa: E402
from src.models import resnet18  # noqa: E402


def timed(work, device: torch.device, repeats: int) -> float:
    """The median seconds of `work()`, the device's queue drained before and after each."""
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timings of each; the median")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = resnet18(in_channels=3, num_classes=10, small_images=True).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    images = torch.randn(8, 3, 32, 32, device=device)
    torch.nn.functional.cross_entropy(model(images), torch.arange(8, device=device)).backward()
    optimizer.step()  # Adam's moments exist: the state a save holds
    parts = {"model": Weights(model), "optimizer": OptimizerState(optimizer, model)}
    moments = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = [*model.state_dict().values(), *moments]  # all the state's tensors
    megabytes = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    copied = {n: p.state_dict() for n, p in parts.items()}  # its import, once a run, not timed
    copy_s = timed(lambda: {n: p.state_dict() for n, p in parts.items()}, device, args.repeats)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "last.pt"
        save_s = timed(
            lambda: write_atomically(path, lambda file: torch.save(copied, file)),
            device,
            args.repeats,
        )
    print(
        f"ResNet-18 with Adam on {device}: {megabytes:.0f} MB of state; the copy to the CPU at "
        f"each save {copy_s * 1000:.1f} ms, writing it {save_s * 1000:.1f} ms"
    )
    line = {"device": str(device), "state_mb": megabytes, "copy_s": copy_s, "save_s": save_s}
    print(json.dumps({**line, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
