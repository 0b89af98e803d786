"""The ceiling for bench/run.py: a hand-written loop over the same in-memory tensors.

One epoch of the same recipe (model, global batch, SGD, sample order), with no config, logging,
checkpoints or signal handling; under torchrun, plain DistributedDataParallel. Prints one JSON
line: the epoch's training images per second.

    python bench/bare.py --model mlp --root /usr/share/datasets/fashion-mnist
    torchrun --nproc_per_node=2 bench/bare.py --model mlp --root ...
"""

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from src.data import FILES, find_file, find_idx_folder, read_idx  # noqa: E402
from src.models import CNN, MLP  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--root", required=True, help="folder with the Fashion-MNIST IDX files")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    ddp = "RANK" in os.environ
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    rank, world = 0, 1
    if ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()

    folder = find_idx_folder(Path(args.root), "FashionMNIST")
    images = read_idx(find_file(folder, FILES["train"][0])).unsqueeze(1).to(device)
    labels = read_idx(find_file(folder, FILES["train"][1])).long().to(device)
    torch.manual_seed(1)
    model = (MLP(784, 512, 10) if args.model == "mlp" else CNN(10, 0.25, 0.5)).to(device)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))

    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for first in range(0, len(labels), args.batch_size):
        index = order[first : first + args.batch_size][rank::world].to(device)
        x = images.index_select(0, index).float().div_(255).sub_(0.2860).div_(0.3530)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), labels.index_select(0, index))
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    if rank == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            json.dumps(
                {
                    "time/train_s": seconds,
                    "time/images_per_s": len(labels) / seconds,
                    "memory/peak_rss_mb": peak,
                }
            )
        )
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
