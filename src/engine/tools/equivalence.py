"""`python train.py debug=equivalence <your overrides>`: does DDP (or FSDP, with parallel=fsdp)
train your config exactly as one process does?

It trains `debug.steps` optimizer steps of the config as composed (model, optimizer, schedule,
batches) in up to four layouts, from the same initial weights on the same global
batches: one process on whole batches (the reference), one process in micro-batches (gradient
accumulation), 2 DDP processes, and 2 DDP processes in micro-batches. Then it evaluates each
layout's weights on the validation and test splits, prints a table and a verdict, and exits 1
when a layout differs from the reference by more than float rounding, with the likely causes it
can see. The DDP processes are gloo processes on the CPU, or nccl processes on 2 GPUs where there
are 2; with parallel=fsdp in the overrides they are FSDP processes instead.

The layouts train in float64 (`debug.precision=64`, the default): float32 rounding, carried on by
training, tips near ties and is magnified by adaptive optimizers, and would pass for a
difference; float64's is 5e8 times finer. `debug.precision=train` compares in the precision the
config trains in (trainer.precision), with that precision's tolerance; so does a model that
cannot run in float64 (a float32 tensor made inside its forward), with the reason said.

Dropout layers are switched off in every layout: each process draws its own masks, so with
them no two layouts could agree. Randomness of any other kind is one of the causes named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import field
from pathlib import Path

import torch
from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.engine import checkpoint, launch, parallel
from src.engine.build import build_model, build_parts, configure_kernels
from src.engine.checkpoint import Checkpointer
from src.engine.config import Settings, Trainer, read_settings
from src.engine.core.context import Hook, Hooks, Run
from src.engine.core.evaluate import evaluate
from src.engine.core.loop import fit
from src.engine.core.state import Parts, Progress
from src.engine.core.task import Task
from src.engine.data import Data
from src.engine.errors import UserError, first_line, instantiated
from src.engine.guards import drift
from src.engine.parallel import Process
from src.engine.parallel.devices import pick_device

log = logging.getLogger("equivalence")

PRECISIONS = ("64", "train")  # debug.precision: float64, or the config's own

PROCESSES = 2
# Float rounding: sums taken in another order (2 processes' shares, micro-batches) differ in their
# last bits, and training carries that on. Measured over 20 steps of Fashion-MNIST on the CPU:
# the CNN within 3e-7 in float32, 4.2e-16 in float64; a small ViT with Adam (the tests' data)
# within 1.4e-13 in float64, where float32 differed by 8.8e-5; a real difference (BatchNorm on
# half a batch, randomness in the model) was 7e-2 or more. bfloat16, float16 and TF32 matmuls
# (matmul_precision=high) round at 4e-3, 5e-4 and 1e-3 in each operation: their bound is wide,
# and ranks that drift apart fail the check anyway.
FLOAT64, FLOAT32, LOWER_PRECISION = 1e-9, 1e-5, 1e-2
# A gradient this small against the model's largest is float rounding of a gradient that is 0
# (float32's rounding is 1.2e-7 of the terms summed; a real gradient is rarely 1e-6 of the largest).
ZERO_GRADIENT = 1e-6
# A loss difference that first passes the tolerance at this many times the largest before it
# jumped: a near tie flipped. (Rounding's differences grew at most 3 times from one step to the
# next, measured over 40 float32 steps of the MLP and of a small ViT.)
JUMP = 20
# The optimizer state of optimizers that divide each gradient by its own running size (Adam,
# AdamW, RMSprop, Adagrad, Adadelta, Adamax): rounding noise of a zero gradient becomes a step.
ADAPTIVE_STATE = ("exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf")
# The one failure of DDP's that a model causes and this check explains; any other error is a bug
# that stops every process, with its traceback.
DDP_UNUSED_PARAMETERS = (
    "Expected to have finished reduction in the prior iteration before starting a new one"
)


class NotEquivalent(CompactHydraException):
    """A layout trained something else than one process did (Hydra prints the message, exit 1)."""


@dataclasses.dataclass
class Trace:
    """What one layout did."""

    losses: list[float] = field(default_factory=list)  # each step's loss over its global batch
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # at the end, on the CPU
    evals: dict[str, dict] = field(default_factory=dict)  # val / test: evaluate()'s, and size
    no_grad: list[str] = field(default_factory=list)  # parameters without a gradient, step 1
    rank_buffers: list[str] = field(default_factory=list)  # buffers the ranks differ in, step 1
    drifted: tuple[int, str, int] | None = None  # (step, parameter, rank): ranks differ there
    failed: str | None = None  # DDP's refusal that ended its training early, and its step
    # One process: each gradient element's largest magnitude over the steps, and whether the
    # optimizer divides by a running size of the gradients.
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)
    adaptive: bool = False


def check(cfg: DictConfig) -> None:
    """Train the layouts, print the table and the verdict; raise NotEquivalent if they differ."""
    if launch.under_torchrun() or "RANK" in os.environ:
        raise UserError(
            "debug=equivalence starts its own DDP processes: run python train.py "
            "debug=equivalence ... without torchrun."
        )
    settings = read_settings(cfg)
    trainer, task = settings.trainer, settings.task
    steps, tolerance = cfg.debug.steps, cfg.debug.tolerance
    if not (isinstance(steps, int) and steps >= 1):
        raise UserError(f"debug.steps={steps}: train at least 1 step in each layout.")
    if tolerance is not None and not tolerance > 0:
        raise UserError(f"debug.tolerance={tolerance}: use a bound above 0, or null.")
    precision = str(cfg.debug.get("precision", "64"))
    if precision not in PRECISIONS:
        raise UserError(
            f"debug.precision={precision}: use 64 (compare in float64) or train (in "
            f"trainer.precision={trainer.precision})."
        )
    group = group_of(cfg, settings)
    micro = micro_batches(cfg, settings)
    gpus = torch.cuda.device_count() >= PROCESSES and str(cfg.device) in ("auto", "cuda")
    device, mode = "cuda" if gpus else "cpu", parallel.build(group).name
    in_what = (
        "in float64, so that rounding cannot pass for a difference (debug.precision=train: in "
        "the config's own precision)" if precision == "64"
        else f"in trainer.precision={trainer.precision} (debug.precision=train)"
    )  # fmt: skip
    log.info(
        "Training %d steps in each layout, %s, dropout off, on %s (%s)",
        steps, in_what, "GPUs" if gpus else "the CPU", "nccl" if gpus else "gloo",
    )  # fmt: skip
    process = Process(device=pick_device(device))
    one, chosen, data, fallback = compared(cfg, device, micro, precision == "64", task, process)
    trainer = chosen.trainer
    if fallback:
        log.warning(
            "Comparing in trainer.precision=%s instead, with its tolerance: %s",
            trainer.precision, fallback,
        )  # fmt: skip
    if tolerance is None:
        exact = trainer.precision == "32" and trainer.matmul_precision == "highest"
        tolerance = FLOAT64 if trainer.precision == "64" else FLOAT32 if exact else LOWER_PRECISION
    processes = layout_config(cfg, device, micro, group, trainer.precision)
    traces = train_layouts(one, chosen, process, data)
    traces += launch.start_workers(group_layouts, processes, PROCESSES)
    layouts = dict(zip(layout_names(micro, mode), traces, strict=True))
    reference = traces[0]
    rows = {name: compare(trace, reference, steps) for name, trace in layouts.items()}
    log.info("\n%s", table(rows, reference))
    differ = [name for name, row in rows.items() if not row.within(tolerance)]
    if not differ:
        log.info(
            "Equivalent: every layout trains this config as one process does, within %s "
            "rounding (tolerance %.0e): %s only the speed.",
            {FLOAT64: "float64", FLOAT32: "float32"}.get(tolerance, "its precision's"), tolerance,
            f"parallel={mode} and trainer.accumulate_grad_batches change" if micro
            else f"parallel={mode} changes",
        )  # fmt: skip
        return
    model, batch = probe(one, chosen, process, data)
    causes = likely_causes(layouts, rows, differ, model, randomness(model, task, batch, trainer),
                           parallel.build(processes.parallel), tolerance)  # fmt: skip
    raise NotEquivalent(
        f"Not equivalent: {' and '.join(differ)} trained something else than 1 process did "
        f"(tolerance {tolerance:.0e}). Likely causes:\n" + "\n".join(f"- {c}" for c in causes)
    )


def group_of(cfg: DictConfig, settings: Settings) -> DictConfig:
    """The parallel node of the compared processes: the config's own where its mode is one of a
    process group, else the mode `debug.parallel` names."""
    return cfg.parallel if settings.parallel.in_group else preset(cfg.debug.parallel)


def preset(mode: str) -> DictConfig:
    """The keys of the engine's parallel mode `mode` (conf/parallel/<mode>.yaml's start), with
    the class that trains it."""
    return ConfigStore.instance().load(f"schema/parallel/{mode}.yaml").node


def compared(
    cfg: DictConfig, device: str, micro: int | None, float64: bool, task: Task, process: Process
) -> tuple[DictConfig, Settings, Data, str | None]:
    """The one-process layouts' config, its settings and its data set up on `process`: in
    float64 where asked and the model runs in it, else in the config's own precision; and why
    float64 was not used, where it was asked for."""

    def set_up(precision: str | None) -> tuple[DictConfig, Settings, Data]:
        one = layout_config(cfg, device, micro, preset("none"), precision)
        settings = read_settings(one)
        configure_kernels(settings.trainer)
        data = instantiated("data", one.data)
        data.setup(process, settings.trainer.dtype, settings.trainer.memory_format)
        return one, settings, data

    fallback = None
    if float64:
        one, settings, data = set_up("64")
        if not (fallback := float64_fails(one, settings, task, process, data)):
            return one, settings, data, None
    return *set_up(None), fallback


def float64_fails(
    cfg: DictConfig, settings: Settings, task: Task, process: Process, data: Data
) -> str | None:
    """Why the model cannot train in float64 (one forward and backward of the first batch), or
    None where it can: a model that makes float32 tensors in its forward meets float64 ones."""
    try:
        model, batch = probe(cfg, settings, process, data)  # its preflight: a forward
        gradients(model, task, batch, settings.trainer)
    except (UserError, RuntimeError, TypeError) as err:
        error = err.__context__ if isinstance(err, UserError) and err.__context__ else err
        return f"the model fails in float64 ({first_line(error)})"
    return None


def micro_batches(cfg: DictConfig, settings: Settings) -> int | None:
    """The micro-batches of the accumulation layouts: the user's own accumulation, else 2; None
    where a process's share does not split that far, or the processes' mode refuses it."""
    trainer = settings.trainer
    micro = trainer.accumulate_grad_batches if trainer.accumulate_grad_batches > 1 else 2
    if cfg.data.batch_size % PROCESSES:
        raise UserError(
            f"debug=equivalence splits each global batch over {PROCESSES} DDP processes, and "
            f"data.batch_size={cfg.data.batch_size} does not split in {PROCESSES}: use an even "
            "one."
        )
    if cfg.data.batch_size // PROCESSES < micro:
        return None
    accumulating = dataclasses.replace(trainer, accumulate_grad_batches=micro)
    try:  # static_graph=true cannot accumulate, for one
        parallel.build(group_of(cfg, settings)).check(
            dataclasses.replace(settings, trainer=accumulating)
        )
    except UserError as err:
        log.info("No micro-batch layouts: %s", err)
        return None
    return micro


def layout_names(micro: int | None, mode: str = "ddp") -> list[str]:
    """The layouts, in the order they are trained: each process count, then with micro-batches."""
    names = []
    for processes in ("1 process", f"{PROCESSES} {mode.upper()} processes"):
        names += [processes] + ([f"{processes} × {micro} micro-batches"] if micro else [])
    names[0] += " (reference)"
    return names


def layout_config(
    cfg: DictConfig, device: str, micro: int | None, mode: DictConfig, precision: str | None = None
) -> DictConfig:
    """The user's config on `device`, trained as the parallel node `mode` says (in 2 processes
    where it is one of a group), with the layouts' micro-batches, and `precision` for
    trainer.precision (None: the config's)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    if precision is not None:
        config["trainer"]["precision"] = precision
    config["parallel"] = OmegaConf.to_container(mode, resolve=True)
    if parallel.build(mode).in_group:
        config["parallel"]["nproc_per_node"] = PROCESSES
    config.update(device=device)
    config["debug"]["micro_batches"] = micro
    return OmegaConf.create(config)


def group_layouts(cfg: DictConfig, run_dir: Path) -> list[Trace]:
    """One process of the group (started by `launch.start_workers`): its layouts' traces."""
    settings = read_settings(cfg)
    trainer = settings.trainer
    configure_kernels(trainer)
    process = settings.parallel.setup(settings.device, trainer)
    try:
        data = instantiated("data", cfg.data)
        data.setup(process, trainer.dtype, trainer.memory_format)
        return train_layouts(cfg, settings, process, data)
    finally:
        parallel.teardown()


def train_layouts(cfg: DictConfig, settings: Settings, process: Process, data: Data) -> list[Trace]:
    """This process's layouts: whole batches, then micro-batches (`debug.micro_batches`)."""
    weights = checkpoint.find_weights(settings, process)  # init_from, where the config has one
    counts = [1] + ([cfg.debug.micro_batches] if cfg.debug.micro_batches else [])
    traces = []
    for k in counts:
        trainer = dataclasses.replace(settings.trainer, accumulate_grad_batches=k)
        run = Run(process, dataclasses.replace(settings, trainer=trainer), data)
        traces.append(train_layout(cfg, run, weights))
    return traces


def train_layout(cfg: DictConfig, run: Run, weights: tuple | None) -> Trace:
    """Train `debug.steps` steps with the training loop itself (its step, its schedule, its
    validations), watching what makes layouts differ; evaluate the weights it ends with."""
    steps, strategy, data = cfg.debug.steps, run.strategy, run.data
    model = build_model(cfg, run, weights)
    dropouts_off(strategy.unwrap(model))
    parts, progress, _ = build_parts(cfg, run, model, None)  # the schedule planned as configured
    trace = Trace()
    # Only debug.steps of it, whatever the config's epochs, a check after each step, no file.
    epochs = max(run.trainer.epochs, math.ceil(steps / data.steps_per_epoch))
    trainer = dataclasses.replace(run.trainer, epochs=epochs, max_steps=steps, test_weights="last",
                                  log_every_n_steps=1, early_stopping_patience=None)  # fmt: skip
    policy = dataclasses.replace(run.settings.checkpoint, save=False)
    fitting = dataclasses.replace(
        run, settings=dataclasses.replace(run.settings, trainer=trainer, checkpoint=policy),
        hooks=Hooks([Watcher(trace)]),
    )  # fmt: skip
    fitting.checkpointer = Checkpointer(policy, Path.cwd(), run.process, strategy, {}, {})
    try:
        fit(fitting, parts, progress)
    except RuntimeError as err:
        if DDP_UNUSED_PARAMETERS not in str(err):
            raise
        trace.failed = f"step {len(trace.losses) + 1}: {DDP_UNUSED_PARAMETERS}"
    for split in ("val", "test"):
        if data.size(split):
            metrics = evaluate(run, model, split)
            trace.evals[split] = {**metrics, "size": data.size(split)}
    state = strategy.model_state(model)  # gathered onto rank 0 where the mode shards it
    trace.weights = {name: tensor.detach().cpu().clone() for name, tensor in state.items()}
    return trace


class Watcher(Hook):
    """After each step of a layout: its loss over the global batch, and what makes layouts differ
    (parameters without a gradient and buffers the ranks differ in after the first step,
    parameters the ranks differ in; in the reference, each gradient's size)."""

    def __init__(self, trace: Trace) -> None:
        self.trace, self.loss = trace, None

    @contextlib.contextmanager
    def active(self, run: Run, parts: Parts, progress: Progress) -> Iterator[None]:
        self.parts = parts
        yield

    def after_step(self, run: Run, progress: Progress, loss: torch.Tensor) -> None:
        self.loss = loss
        model, process = run.strategy.unwrap(self.parts.model), run.process
        trace, step = self.trace, progress.step
        if step == 1:
            trace.no_grad = [
                name for name, p in model.named_parameters() if p.requires_grad and p.grad is None
            ]
            trace.rank_buffers = list(drift.differing(process, list(model.named_buffers())))
        if trace.drifted is None and run.strategy.replicated:  # sharded: each rank its own part
            found = drift.differing(process, list(model.named_parameters()))
            trace.drifted = next(((step, name, rank) for name, rank in found.items()), None)
        if process.world_size == 1 and run.trainer.accumulate_grad_batches == 1:  # the reference
            watch_gradients(trace, model, self.parts.optimizer)

    def votes(self, run: Run, progress: Progress, weights: nn.Module | None) -> list[float]:
        return [] if self.loss is None else [self.loss.item()]

    def agreed(
        self, run: Run, progress: Progress, sums: list[float], weights: nn.Module | None
    ) -> None:
        if sums:  # the first check after a step: the global batch's loss
            self.trace.losses.append(sums[0] / run.process.world_size)
            self.loss = None


def watch_gradients(trace: Trace, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One process, after a step: each gradient element's largest magnitude so far, and whether
    the optimizer divides each gradient by its own running size."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            size = p.grad.detach().abs().cpu()
            seen = trace.gradients.get(name)
            trace.gradients[name] = size if seen is None else torch.maximum(seen, size)
    trace.adaptive = any(key in ADAPTIVE_STATE for s in optimizer.state.values() for key in s)


def dropouts_off(model: nn.Module) -> None:
    """Dropout layers become identities: each process would draw its own masks. (Not switched to
    eval mode, which the loop's model.train() would switch back.)"""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.modules.dropout._DropoutNd):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, nn.Identity())


@dataclasses.dataclass
class Difference:
    """How far a layout is from the reference: the largest relative loss difference of any step
    (and its step), the largest weight difference (relative to its tensor's largest weight, where
    that is above 1; and where), the largest relative difference of the evaluated splits' losses,
    and the change in their correct predictions (shown, not judged: a rounding difference may
    flip a prediction that was a near tie)."""

    loss: tuple[float, int | None]
    weight: tuple[float, str | None]
    eval_loss: float
    correct: dict[str, int]
    failed: str | None  # DDP's refusal, if training stopped early
    complete: bool  # it trained every step
    drifted: bool  # its DDP ranks' parameters differed, which rounding never explains
    eval_losses: dict[str, float] = field(default_factory=dict)  # each split's, relative
    steps: list[float] = field(default_factory=list)  # each step's relative loss difference

    def within(self, tolerance: float) -> bool:
        worst = max(self.loss[0], self.weight[0], self.eval_loss)
        return self.complete and not self.drifted and worst <= tolerance


def compare(trace: Trace, reference: Trace, steps: int) -> Difference:
    """How far `trace` is from the reference."""
    pairs = zip(trace.losses, reference.losses, strict=False)
    per_step = [abs(a - b) / max(abs(b), 1e-12) for a, b in pairs]
    loss = max(((d, step) for step, d in enumerate(per_step, 1)), default=(0.0, None))
    weight = max(
        (
            ((a.double() - b.double()).abs().max().item() / max(1.0, b.abs().max().item()), name)
            for name, a in trace.weights.items()
            if (b := reference.weights[name]).is_floating_point() and b.numel()
        ),
        default=(0.0, None),
    )
    evals = reference.evals  # the task's loss metric, where it reports one; its correct counts
    eval_losses = {s: abs(m[f"{s}/loss"] / evals[s][f"{s}/loss"] - 1)
                   for s, m in trace.evals.items() if f"{s}/loss" in m}  # fmt: skip
    eval_loss = max(eval_losses.values(), default=0.0)
    correct = {s: m[f"{s}/correct"] - evals[s][f"{s}/correct"]
               for s, m in trace.evals.items() if f"{s}/correct" in m}  # fmt: skip
    complete = len(trace.losses) == steps and trace.failed is None
    drifted = trace.drifted is not None and trace.failed is None
    return Difference(loss, weight, eval_loss, correct, trace.failed, complete, drifted,
                      eval_losses, per_step)  # fmt: skip


def table(rows: dict[str, Difference], reference: Trace) -> str:
    """The layouts' differences side by side, under the reference's correct predictions (a task
    that counts none: its evaluated loss, and each layout's relative difference from it)."""
    splits = list(reference.evals)
    counted = {s: f"{s}/correct" in reference.evals[s] for s in splits}
    header = ["layout", "loss (step)", "weights (where)"]
    header += [f"{s} correct" if counted[s] else f"{s} loss" for s in splits]
    lines = [header]
    for name, row in rows.items():
        evals = reference.evals
        if name.endswith("(reference)"):
            counts = [
                f"{evals[s][f'{s}/correct']}/{evals[s]['size']}"
                if counted[s]
                else f"{evals[s].get(f'{s}/loss', float('nan')):.4g}"
                for s in splits
            ]
            lines.append([name, "-", "-", *counts])
            continue
        (loss, step), (weight, where) = row.loss, row.weight
        counts = [f"{row.correct.get(s, 0):+d}" if counted[s]
                  else f"{row.eval_losses.get(s, 0.0):.1e}" for s in splits]  # fmt: skip
        loss_text = f"{loss:.1e} ({step})"
        if row.failed:
            loss_text = f"failed at {row.failed.split(':')[0]}"
        lines.append([name, loss_text, f"{weight:.1e} ({where})", *counts])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def likely_causes(
    layouts: dict[str, Trace],
    rows: dict[str, Difference],
    differ: list[str],
    model: nn.Module,
    randomness: tuple[bool, bool],
    strategy: parallel.Strategy,
    tolerance: float = FLOAT32,
) -> list[str]:
    """What could make the layouts `differ`, from what the runs and their `rows` (differences
    from the reference, beyond `tolerance`), the one-process `model`, its `randomness` (random,
    repeatable) and the DDP layouts' `parallel` settings show."""
    reference = next(iter(layouts.values()))
    failures: dict[str, list[str]] = {}
    for name in differ:
        if failed := layouts[name].failed:
            failures.setdefault(failed, []).append(name)
    causes = [f"{' and '.join(names)} stopped at {failed}" for failed, names in failures.items()]
    if reference.no_grad and not getattr(strategy, "find_unused_parameters", False):
        causes.append(
            f"parameters that get no gradient: {', '.join(reference.no_grad[:5])}. DDP with "
            "parallel.find_unused_parameters=false fails on them: set it true (slower), or take "
            "them out of the model"
        )
    norms = [name for name, m in model.named_modules() if is_batch_norm(m)]
    if norms:
        causes.append(batch_norm_cause(norms, differ, strategy.sync_batchnorm))
    ddp_buffers = {b for name in differ for b in layouts[name].rank_buffers}
    others = sorted(b for b in ddp_buffers if not b.startswith(tuple(f"{n}." for n in norms)))
    if others:
        causes.append(
            f"buffers that differ between the DDP processes after a step: {', '.join(others[:5])}"
        )
    for name in differ:  # after a failure, the ranks' weights are anyone's guess
        if (drifted := layouts[name].drifted) and not layouts[name].failed:
            step, parameter, rank = drifted
            causes.append(
                f"in {name}, rank {rank}'s {parameter} differed from rank 0's after step {step}: "
                "some code changes weights outside the optimizer step, on some ranks only"
            )
    random, repeatable = randomness
    if random:
        causes.append(
            "the model draws random numbers in training (not in a dropout layer, which this "
            "check switches off): each process draws its own; make it a dropout layer, or draw "
            "it in eval mode only"
        )
    elif not repeatable:
        causes.append(
            "the same step twice gives other gradients: non-deterministic kernels; run with "
            "trainer.deterministic=true"
        )
    worst = max(differ, key=lambda name: rows[name].weight[0])
    if rounding := zero_gradients(reference, rows[worst].weight[1]):
        causes.append(rounding)
    if course := loss_course(differ, rows, tolerance):
        causes.append(course)
    if not causes:
        where = rows[worst].weight[1]
        causes.append(
            f"none this check can see; the largest weight difference is in {where} ({worst})"
        )
    return causes


def zero_gradients(reference: Trace, where: str | None) -> str | None:
    """Parameters whose gradient (in the reference, over every step) is zero up to rounding, under
    an optimizer that divides by the gradients' running size: it makes the noise a step."""
    if not reference.adaptive or not reference.gradients:
        return None
    largest = max(g.max().item() for g in reference.gradients.values())
    noise = {  # exactly 0 is the same in every layout, and the optimizer does not move it
        name: int(((g > 0) & (g <= ZERO_GRADIENT * largest)).sum())
        for name, g in reference.gradients.items()
    }
    found = [name for name, count in noise.items() if count]
    if not found:
        return None
    sizes = {name: reference.gradients[name].numel() for name in found}
    named = ", ".join(f"{name} ({noise[name]} of {sizes[name]})" for name in found[:5])
    there = f"; the largest weight difference is in {where}" if where in found else ""
    return (
        f"parameters whose gradient is zero up to rounding (at most {ZERO_GRADIENT:.0e} of the "
        f"largest, in the reference): {named}{there}. The optimizer divides each gradient by "
        "its own running size, which turns that noise into steps of about the learning rate, "
        "other ones in each layout: rounding, not DDP. Compare in float64 (debug.precision=64, "
        "the default), or leave them out of the model (e.g. bias=False on an attention's key "
        "projection), or raise the optimizer's eps"
    )


def loss_course(differ: list[str], rows: dict[str, Difference], tolerance: float) -> str | None:
    """How the loss difference of the layout that differs most came about: from the first step
    (a real difference), a jump from rounding level at one step (a near tie flipped), or growth."""
    name = max(differ, key=lambda n: rows[n].loss[0])
    steps = rows[name].steps
    over = next((i for i, d in enumerate(steps) if d > tolerance), None)
    if over is None:
        return None
    before, at = max(steps[:over], default=0.0), steps[over]
    if over == 0:
        return (
            f"in {name} the loss differs from the first step ({at:.1e}): the layouts compute "
            "something else (a sample, a scale, the model's own state), not rounding"
        )
    if at >= JUMP * before:  # within rounding up to there, and 20 times that in one step
        return (
            f"in {name} the loss jumps at step {over + 1}, from rounding ({before:.0e} up to "
            f"there) to {at:.1e}: a near tie (a ReLU, a max, an argmax) that rounding tipped "
            "the other way, which training carries on: rounding, not DDP (float64, "
            "debug.precision=64, makes such ties far rarer)"
        )
    return (
        f"in {name} the loss difference grows from step 1 ({steps[0]:.0e}) to {at:.1e} at step "
        f"{over + 1}: a difference in what the layouts compute, compounding"
    )


def batch_norm_cause(norms: list[str], differ: list[str], synced: bool) -> str:
    """Why BatchNorm layers make the layouts in `differ` differ."""
    layers = f"BatchNorm layers ({', '.join(norms[:5])})"
    if synced:
        return (
            f"{layers} normalise each micro-batch by its own statistics: no setting makes "
            "accumulation match whole batches there (parallel.sync_batchnorm=true covers the "
            "processes only)"
        )
    micro = " and each micro-batch" if any("micro-batches" in name for name in differ) else ""
    return (
        f"{layers} normalise each process's share{micro} by its own statistics: "
        "parallel.sync_batchnorm=true shares them between processes (CUDA GPUs), or use "
        "GroupNorm or LayerNorm"
    )


def is_batch_norm(module: nn.Module) -> bool:
    """BatchNorm that normalises by this process's batch alone (SyncBatchNorm shares it)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, nn.SyncBatchNorm
    )


def probe(
    cfg: DictConfig, settings: Settings, process: Process, data: Data
) -> tuple[nn.Module, tuple]:
    """The config's model as one process builds it, dropout off, and its first batch."""
    weights = checkpoint.find_weights(settings, process)
    run = Run(process, settings, data)
    model = build_model(cfg, run, weights)
    model.train()
    dropouts_off(run.strategy.unwrap(model))
    return model, next(data.train_batches(1))


def randomness(model: nn.Module, task: Task, batch: tuple, trainer: Trainer) -> tuple[bool, bool]:
    """Whether the gradients of `batch` depend on the random seed (randomness in the model), and
    whether they are the same twice with one seed (deterministic kernels); with the task's loss,
    as training computes it."""
    first, again, other = (gradients(model, task, batch, trainer, seed) for seed in (0, 0, 1))
    same = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    seeded = all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    return same and not seeded, same


def gradients(
    model: nn.Module, task: Task, batch: tuple, trainer: Trainer, seed: int = 0
) -> list[torch.Tensor]:
    """The gradients of the task's loss on one process's `batch`, as training computes them,
    with the random generators seeded by `seed`."""
    inputs, targets, _ = batch
    count = task.count(inputs, targets)  # one process's batch: its own count is the global one
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with trainer.autocast(inputs.device):
        loss = task.loss(model(inputs), inputs, targets) / count
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]
