"""The engine: the loop, the parallel modes, checkpoints, the config schema. A fork adds files
beside it (src/models.py, src/datasets.py, src/tasks.py, conf/) and leaves it as it is."""
