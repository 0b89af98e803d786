"""Train a classifier on MNIST on one device, with DataParallel, or with DDP or FSDP under torchrun.

    python train.py                                           # one device
    python train.py parallel=dp                               # nn.DataParallel over the GPUs
    torchrun --nproc_per_node=4 train.py parallel=ddp         # DistributedDataParallel, 4 processes
    python train.py parallel=ddp parallel.nproc_per_node=4    # the same, processes started here
    torchrun --nproc_per_node=4 train.py parallel=fsdp        # FSDP: the model sharded over 4
    python train.py -m optimizer.lr=0.1,0.01 model=mlp,cnn    # a Hydra sweep
    python train.py train=false ckpt_path=PATH                # evaluate a checkpoint
    python train.py debug=equivalence model=cnn               # does DDP train it as one process?

Every knob is in conf/; `python train.py --help` lists them. The way through, a file each:
compose the config (conf/, its schema in src/engine/config.py) → set up the process: here, under
torchrun, or in the processes started here (`main` in src/engine/app.py, which a script of your own
calls the same way: docs/layout.md) → build the data, model and optimizer (src/engine/build.py) →
fit (src/engine/core/loop.py) → test and finish (`train` in src/engine/app.py, top to bottom).
"""

from src.engine.app import main

if __name__ == "__main__":  # the processes parallel=ddp starts import this file too
    main()  # the template's config, conf/; on failure, Hydra exits non-zero from inside
