"""The ceiling for bench/run.py: a hand-written loop over the same in-memory tensors.

One epoch of the same recipe (model, global batch, SGD, sample order), or --epochs N each timed
alone (the first, then the steady ones), with no config, logging, checkpoints or signal handling;
under torchrun, plain DistributedDataParallel. Prints one JSON line: the first epoch's training
images per second, and with --epochs 2 or more the last epoch's (steady/...).

    python bench/bare.py --model mlp --root /usr/share/datasets/fashion-mnist
    torchrun --nproc_per_node=2 bench/bare.py --model mlp --root ...
    python bench/bare.py --model cnn --batch-size 1024 --precision bf16 --channels-last \
        --compile reduce-overhead --warmup-steps 5 --root ...     # the GPU recipe

--warmup-steps trains that many steps before the clock starts (not undone: this loop only
measures speed) so that compilation and CUDA graph capture stay out of the timing. --steps times
only the epoch's first steps. bench/scaling.py varies the rest under torchrun: DDP's
--bucket-cap-mb and --gradient-as-bucket-view, --accumulate (each step's share split into
micro-batches, all-reducing in the last one's backward only, as src/engine/core/loop.py's train_step
does) and --no-communication (a DDP hook that skips the all-reduce: the same step, compute only;
--also-no-communication times it after the all-reduce's run, in the same processes).
"""

import argparse
import copy
import json
import os
import resource
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from src.datasets import IDX_FILES, find_idx_folder, idx_files, read_idx  # noqa: E402
from src.engine.data import GlobalBatchSampler  # noqa: E402


def recipe(model: str) -> tuple[torch.nn.Module, float, float, int]:
    """The template's own values, read from conf/ as train.py composes them: the model (built
    with the config's seed), Fashion-MNIST's mean and std, and the seed."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    import src.engine.config  # noqa: F401 - the schema conf/config.yaml starts from

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["data=fashion_mnist", f"model={model}"])
    torch.manual_seed(cfg.seed)
    return instantiate(cfg.model), cfg.data.mean, cfg.data.std, cfg.seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--root", required=True, help="folder with the Fashion-MNIST IDX files")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--precision", choices=["32", "bf16"], default="32")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", metavar="MODE", help="torch.compile mode (default: eager)")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--steps", type=int, help="time this many steps (default: the epoch)")
    parser.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="time this many epochs, each on its own: the first, then the steady ones",
    )
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--bucket-cap-mb", type=float, help="DDP's (default 25)")
    parser.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP's")
    parser.add_argument(
        "--no-communication",
        action="store_true",
        help="DDP without the all-reduce (debugging_hooks.noop_hook): compute only",
    )
    parser.add_argument(
        "--also-no-communication",
        action="store_true",
        help="time the steps a second time, from the same weights, with the no-op hook",
    )
    args = parser.parse_args()

    ddp = "RANK" in os.environ
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    rank, world = 0, 1
    if args.steps is not None and args.steps < 1:
        parser.error("--steps: time at least 1 step")
    ddp_only = (args.bucket_cap_mb, args.gradient_as_bucket_view, args.no_communication,
                args.also_no_communication)  # fmt: skip
    if not ddp and any(ddp_only):
        parser.error("the DDP options need DDP: launch with torchrun --nproc_per_node=N")
    if ddp:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # else every rank's NCCL and kernels start on GPU 0
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()

    folder = find_idx_folder(Path(args.root), "FashionMNIST")
    images_file, labels_file = (idx_files(folder)[name] for name in IDX_FILES["train"])
    images = read_idx(images_file).unsqueeze(1).to(device)
    labels = read_idx(labels_file).long().to(device)
    model, mean, std, seed = recipe(args.model)
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=layout)
    sampler = GlobalBatchSampler(len(labels), args.batch_size, rank, world, seed)
    sampler.set_epoch(1)  # the template's first epoch
    order = sampler.permutation().to(device)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if args.precision == "bf16"
        else nullcontext()
    )
    starts = range(0, len(labels), args.batch_size)

    def timed(hook: bool) -> list[float]:
        """Seconds for the timed steps of each epoch, from the recipe's initial weights, with
        DDP's all-reduce or (`hook`) its no-op hook."""
        trained = copy.deepcopy(model)  # the plain module, compiled here: each run its own
        if args.compile:
            # Static shapes: CUDA graphs record one graph per batch shape, in the warm-up.
            trained = torch.compile(trained, mode=args.compile, dynamic=False)
        if ddp:
            ids = [device.index] if device.type == "cuda" else None
            trained = torch.nn.parallel.DistributedDataParallel(
                trained,
                device_ids=ids,
                bucket_cap_mb=args.bucket_cap_mb,
                gradient_as_bucket_view=args.gradient_as_bucket_view,
            )
            if hook:
                trained.register_comm_hook(None, noop_hook)
        optimizer = torch.optim.SGD(trained.parameters(), lr=args.lr)

        def step(first: int) -> None:
            index = order[first : first + args.batch_size][rank::world]
            x = images.index_select(0, index).float().div_(255).sub_(mean).div_(std)
            y = labels.index_select(0, index)
            micro = min(args.accumulate, len(index))
            optimizer.zero_grad(set_to_none=True)
            pieces = zip(x.tensor_split(micro), y.tensor_split(micro), strict=True)
            for i, (xs, ys) in enumerate(pieces):
                # DDP all-reduces in the backward of the last micro-batch only, the sum of them all.
                with nullcontext() if not ddp or i == micro - 1 else trained.no_sync():
                    with autocast:
                        logits = trained(xs.contiguous(memory_format=layout))
                        loss = F.cross_entropy(logits, ys) / micro
                    loss.backward()
            optimizer.step()

        trained.train()
        # The first batches and the last, often smaller, one: each batch shape at least twice, as
        # CUDA graph trees run a new graph once before they record it.
        warm = [*starts[: max(args.warmup_steps, 2)], starts[-1], starts[-1]]
        for first in warm if args.warmup_steps else []:
            step(first)
        sync(device, ddp)
        seconds = []
        for _ in range(args.epochs):  # each timed alone, as the template's Speed hook times it
            started = time.perf_counter()
            for first in starts[: args.steps]:
                step(first)
            sync(device, ddp)
            seconds.append(time.perf_counter() - started)
        return seconds

    timed_starts = starts[: args.steps]
    count = min(len(labels), timed_starts[-1] + args.batch_size) - timed_starts[0]
    first, *steady = timed(hook=args.no_communication)
    line = {"time/train_s": first, "time/images_per_s": count / first}
    if steady:  # the last epoch, past the first's one-time costs
        line |= {"steady/train_s": steady[-1], "steady/images_per_s": count / steady[-1]}
    if args.also_no_communication:  # the same steps again, in these processes
        line["noop/images_per_s"] = count / timed(hook=True)[-1]
    if rank == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({**line, "memory/peak_rss_mb": peak}))
    if ddp:
        dist.destroy_process_group()
        # As train.py's workers do (src/engine/launch/__init__.py: exit_worker): gloo can abort a
        # process while the interpreter tears down, which torchrun would report as a failed run.
        sys.stdout.flush()
        os._exit(0)


def sync(device: torch.device, ddp: bool) -> None:
    """Wait for the GPU's queued work, and (DDP) for every rank: the clock starts when all ranks
    start, and stops when the slowest is done (with the no-op hook, nothing else waits)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if ddp:
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


if __name__ == "__main__":
    main()
