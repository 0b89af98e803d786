"""`python train.py debug=equivalence`: does DDP (or FSDP) train your config as one process does?
It trains `debug.steps` steps with `fit` from the same weights and batches in up to four layouts
(1 process, the reference; micro-batches; 2 processes; both), dropout off, in float64 (or the
config's precision: debug.precision=train), and exits 1 naming likely causes where one differs."""

from __future__ import annotations

import functools
import logging
import math
import os
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.engine import build, checkpoint, launch, parallel, storage
from src.engine.config import Settings
from src.engine.core.context import Hook, Hooks, Parts, Progress, Run
from src.engine.core.evaluate import evaluate
from src.engine.core.loop import fit
from src.engine.errors import UserError, first_line
from src.engine.guards import differing

log = logging.getLogger("equivalence")

PROCESSES = 2
# Sums in another order (processes' shares, micro-batches) round apart, and training carries it on:
# 20 Fashion-MNIST CPU steps: the CNN within 3e-7 in float32, 4.2e-16 in float64, a small ViT with
# Adam 8.8e-5 and 1.4e-13; real differences (BatchNorm on half a batch, randomness) 7e-2 or more.
# bfloat16, float16, TF32 round 4e-3, 5e-4, 1e-3 per operation: a wide bound (drifting ranks fail)
# float64's bound: each operation rounds by u = 2^-53 = 1.1e-16, and a sum of n terms taken in
# another order differs by at most (n-1)·u of the sum of the terms' sizes (in practice √n·u), so a
# step's update differs by a few u of its size; training carries and compounds that (the 1.4e-13
# above is Adam's doing over 20 steps). 1e-9 is 7,000 times that and 10^7 times u, yet far below
# what a real difference moves in step 1 alone (the weights after each step are compared): a
# gradient 1% too large moved the MLP's weights by 5.3e-6 in its first step (the tests' data),
# gradients sent in bfloat16 (8 bits of mantissa, 4e-3 apart) by 1.7e-6.
FLOAT64, FLOAT32, LOWER_PRECISION = 1e-9, 1e-5, 1e-2
ZERO_GRADIENT = 1e-6  # of the largest: a 0 one's rounding (float32's is 1.2e-7 of the terms)
# A difference (the weights after a step) that first passes the tolerance at this many times its
# largest before: a jump, as from a near tie flipped (rounding's grew at most 3-fold a step over
# 40 float32 steps of the MLP and a ViT).
JUMP = 20
# The state of optimizers that divide each gradient by its running size (Adam, AdamW, RMSprop,
# Adagrad, Adadelta, Adamax): they turn the rounding noise of a zero gradient into a step.
ADAPTIVE_STATE = ("exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf")
# DDP's one failure that a model causes and this check explains; any other error is a bug.
DDP_UNUSED_PARAMETERS = (
    "Expected to have finished reduction in the prior iteration before starting a new one"
)


class NotEquivalent(CompactHydraException):
    """A layout trained something else than one process did (Hydra prints the message, exit 1)."""


@dataclass
class Trace(Hook):
    """What one layout did, watched after each step: the loss over the global batch, the weights,
    and what makes layouts differ."""

    losses: list[float] = field(default_factory=list)  # each step's loss over its global batch
    # Each step's weights, each tensor as (its projection, its largest size): see `projections`.
    projected: list[dict[str, tuple[float, float]]] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # at the end, on the CPU
    evals: dict[str, dict] = field(default_factory=dict)  # val / test: evaluate()'s, and size
    no_grad: list[str] = field(default_factory=list)  # parameters without a gradient, step 1
    rank_buffers: list[str] = field(default_factory=list)  # buffers the ranks differ in, step 1
    drifted: tuple[int, str, int] | None = None  # (step, parameter, rank): ranks differ there
    failed: str | None = None  # DDP's refusal that ended its training early, and its step
    gradients: dict[str, torch.Tensor] = field(default_factory=dict)  # the reference's largest
    adaptive: bool = False  # the reference's optimizer divides by the gradients' running size

    def after_step(self, run: Run, parts: Parts, progress: Progress, loss: torch.Tensor) -> None:
        model, process = parallel.unwrap(parts.model), run.process
        step, parameters = progress.step, list(model.named_parameters())
        self.losses.append(process.sum_over_ranks([loss.item()])[0] / process.world_size)
        whole = checkpoint.Weights(parts.model).state_dict()  # gathered onto rank 0 if sharded
        self.projected.append(projections(whole))
        if step == 1:
            self.no_grad = [n for n, p in parameters if p.requires_grad and p.grad is None]
            self.rank_buffers = list(differing(process, list(model.named_buffers())))
        if self.drifted is None and not run.strategy.sharded:  # sharded: each rank its own part
            found = differing(process, parameters)
            self.drifted = next(((step, name, rank) for name, rank in found.items()), None)
        if process.world_size == 1 and run.trainer.accumulate_grad_batches == 1:  # the reference
            sizes = {n: p.grad.detach().abs().cpu() for n, p in parameters if p.grad is not None}
            seen = self.gradients
            self.gradients = {n: torch.maximum(seen.get(n, g), g) for n, g in sizes.items()}
            state = parts.optimizer.state.values()
            self.adaptive = any(key in ADAPTIVE_STATE for s in state for key in s)


def check(cfg: DictConfig) -> None:
    """Train the layouts, print the table and the verdict; raise NotEquivalent if they differ."""
    if launch.under_torchrun() or "RANK" in os.environ:
        raise UserError(
            "debug=equivalence starts its own DDP processes: run python train.py "
            "debug=equivalence ... without torchrun."
        )
    settings = build.read_settings(cfg)
    direction.cache_clear()  # an earlier check's (a sweep's job before): another model's
    steps, tolerance = cfg.debug.steps, cfg.debug.tolerance
    precision, own = str(cfg.debug.get("precision", "64")), settings.trainer.precision
    if not (isinstance(steps, int) and steps >= 1):
        raise UserError(f"debug.steps={steps}: train at least 1 step in each layout.")
    if tolerance is not None and not tolerance > 0:
        raise UserError(f"debug.tolerance={tolerance}: use a bound above 0, or null.")
    if precision not in ("64", "train"):
        raise UserError(
            f"debug.precision={precision}: use 64 (compare in float64) or train (in "
            f"trainer.precision={own})."
        )
    group, micro = group_of(cfg, settings), micro_batches(cfg, settings)
    storage.admit()  # its verdict's log stays in the run folder, pass or fail
    gpus = torch.cuda.device_count() >= PROCESSES and str(cfg.device) in ("auto", "cuda")
    device, mode = "cuda" if gpus else "cpu", build.build_strategy(group).name
    log.info(
        "Training %d steps in each layout, %s, dropout off, on %s",
        steps,
        "in float64, so that rounding cannot pass for a difference (debug.precision=train: in "
        "the config's own precision)"
        if precision == "64"
        else f"in trainer.precision={own} (debug.precision=train)",
        "GPUs (nccl)" if gpus else "the CPU (gloo)",
    )
    one, run = compared(cfg, device, micro, precision == "64")
    trainer = run.trainer
    if tolerance is None:
        exact = trainer.precision == "32" and trainer.matmul_precision == "highest"
        tolerance = FLOAT64 if trainer.precision == "64" else FLOAT32 if exact else LOWER_PRECISION
    processes = layout_config(cfg, device, micro, group, trainer.precision)
    traces = train_layouts(one, run) + launch.start_workers(group_layouts, processes, PROCESSES)
    layouts = dict(zip(layout_names(micro, mode), traces, strict=True))
    monitor = settings.checkpoint.monitor
    rows = {name: compare(trace, traces[0], steps, monitor) for name, trace in layouts.items()}
    log.info("\n%s", table(rows, traces[0], monitor))
    if differ := [name for name, row in rows.items() if not row.within(tolerance)]:
        causes = likely_causes(layouts, rows, differ, probe(one, run), processes, tolerance)
        raise NotEquivalent(
            f"Not equivalent: {' and '.join(differ)} trained something else than 1 process did "
            f"(tolerance {tolerance:.0e}). Likely causes:\n" + "\n".join(f"- {c}" for c in causes)
        )
    log.info(
        "Equivalent: every layout trains this config as one process does, within %s rounding "
        "(tolerance %.0e): parallel=%s%s only the speed.",
        {FLOAT64: "float64", FLOAT32: "float32"}.get(tolerance, "its precision's"),
        tolerance,
        mode,
        " and trainer.accumulate_grad_batches change" if micro else " changes",
    )


def group_of(cfg: DictConfig, settings: Settings) -> DictConfig:
    """The compared processes' parallel node: the config's if a group's, else debug.parallel's."""
    return cfg.parallel if settings.parallel.in_group else preset(cfg.debug.parallel)


def preset(mode: str) -> DictConfig:
    """The engine's parallel node for `mode`, as conf/parallel/<mode>.yaml starts from."""
    return ConfigStore.instance().load(f"schema/parallel/{mode}.yaml").node


def set_up(cfg: DictConfig, process: parallel.Process | None = None) -> Run:
    """`cfg`'s settings and data on `process` (None: one of the process group, joined here), as
    a training run has them (its hooks are each layout's own)."""
    settings = build.read_settings(cfg)  # its kernels set by build_model, as in a training run
    process = process or settings.parallel.setup(settings.device, settings.trainer)
    return build.build_run(cfg, settings, process, Path.cwd())


def compared(
    cfg: DictConfig, device: str, micro: int | None, float64: bool
) -> tuple[DictConfig, Run]:
    """The one-process layouts' config and run: in float64 where asked and possible, else not."""
    process = parallel.Process(device=parallel.pick_device(device))
    if float64:
        one = layout_config(cfg, device, micro, preset("none"), "64")
        run = set_up(one, process)
        try:  # one forward and backward: a float32 tensor made in the forward meets float64 ones
            gradients(*probe(one, run))
            return one, run
        except (UserError, RuntimeError, TypeError) as err:
            if (error := err.__context__ if isinstance(err, UserError) else err) is None:
                raise  # refused in any precision
            log.warning(
                f"Comparing in trainer.precision={cfg.trainer.precision} instead, with its "
                f"tolerance: the model fails in float64 ({first_line(error)})"
            )
    one = layout_config(cfg, device, micro, preset("none"))
    return one, set_up(one, process)


def micro_batches(cfg: DictConfig, settings: Settings) -> int | None:
    """The micro-batches: the config's accumulation, else 2; None where they cannot be used."""
    if cfg.data.batch_size % PROCESSES:
        raise UserError(
            f"debug=equivalence splits each global batch over {PROCESSES} DDP processes, and "
            f"data.batch_size={cfg.data.batch_size} does not split in {PROCESSES}: use an even one."
        )
    micro = max(settings.trainer.accumulate_grad_batches, 2)
    if cfg.data.batch_size // PROCESSES < micro:
        return None
    trainer = replace(settings.trainer, accumulate_grad_batches=micro)
    try:  # static_graph=true cannot accumulate, for one
        build.build_strategy(group_of(cfg, settings)).check(replace(settings, trainer=trainer))
    except UserError as err:
        log.info("No micro-batch layouts: %s", err)
        return None
    return micro


def layout_names(micro: int | None, mode: str = "ddp") -> list[str]:
    """The layouts, in the order they are trained: each process count, then with micro-batches."""
    splits = [""] + ([f" × {micro} micro-batches"] if micro else [])
    names = [n + s for n in ("1 process", f"{PROCESSES} {mode.upper()} processes") for s in splits]
    return [f"{names[0]} (reference)", *names[1:]]


def layout_config(
    cfg: DictConfig, device: str, micro: int | None, mode: DictConfig, precision: str | None = None
) -> DictConfig:
    """The config on `device`, in parallel `mode` (2 processes for a group's) and `precision`."""
    config = OmegaConf.to_container(cfg, resolve=True)
    config["trainer"]["precision"] = precision or config["trainer"]["precision"]
    config["parallel"] = OmegaConf.to_container(mode, resolve=True)
    if build.build_strategy(mode).in_group:
        config["parallel"]["nproc_per_node"] = PROCESSES
    config["device"], config["debug"]["micro_batches"] = device, micro
    return OmegaConf.create(config)


def group_layouts(cfg: DictConfig, run_dir: Path) -> list[Trace]:
    """One process of the group (started by `launch.start_workers`): its layouts' traces."""
    try:
        return train_layouts(cfg, set_up(cfg))
    finally:
        parallel.teardown()


def train_layouts(cfg: DictConfig, run: Run) -> list[Trace]:
    """This process's layouts: whole batches, then micro-batches (`debug.micro_batches`)."""
    weights = checkpoint.find_weights(run.settings, run.process)  # init_from, where there is one
    return [train_layout(cfg, run, weights, k) for k in (1, cfg.debug.micro_batches) if k]


def train_layout(cfg: DictConfig, run: Run, weights: tuple | None, micro: int) -> Trace:
    """Train `debug.steps` steps in `micro` micro-batches with `fit`, watching; then evaluate."""
    steps, data, trace = cfg.debug.steps, run.data, Trace()
    trainer = replace(run.trainer, accumulate_grad_batches=micro, test_weights="last")
    # A task and callbacks of its own, as a run has: a fork's may keep state (a count, an average
    # of the weights) that the layout trained before would otherwise hand on to this one.
    policy = replace(run.settings.checkpoint, save=False)  # no file
    settings = replace(run.settings, trainer=trainer, task=build.build_task(cfg), checkpoint=policy)
    run = replace(run, settings=settings, hooks=Hooks([build.build_callbacks(cfg), trace]))
    model = build.build_model(cfg, run, weights)
    dropouts_off(parallel.unwrap(model))
    # The schedule planned as configured; then only debug.steps of it, whatever the config's
    # epochs, a check after each step.
    parts, progress, run.checkpointer = build.build_parts(cfg, run, model, None)
    epochs = max(trainer.epochs, math.ceil(steps / data.steps_per_epoch))
    trainer = replace(trainer, epochs=epochs, max_steps=steps, log_every_n_steps=1)
    trainer = replace(trainer, early_stopping_patience=None)
    run = replace(run, settings=replace(settings, trainer=trainer))
    try:
        fit(run, parts, progress)
    except RuntimeError as err:
        if DDP_UNUSED_PARAMETERS not in str(err):
            raise
        trace.failed = f"step {len(trace.losses) + 1}: {DDP_UNUSED_PARAMETERS}"
    for split in ("val", "test"):  # through its callbacks: the weights they evaluate (an average)
        if data.size(split):
            trace.evals[split] = {**evaluate(run, model, split), "size": data.size(split)}
    state = checkpoint.Weights(model).state_dict()  # gathered onto rank 0 where the mode shards it
    trace.weights = {name: tensor.detach().cpu().clone() for name, tensor in state.items()}
    return trace


def projections(state: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Each float tensor of `state` as 2 numbers instead of a copy of it each step: its projection
    on a fixed random direction (normal, the same in every process), divided by √size, and its
    largest size. Two layouts' projections differ by about the root mean square of their weights'
    difference (times a normal number: 4 times it at most, but once in 16,000 tensors)."""
    found = {}
    for name, tensor in state.items():
        if not (tensor.is_floating_point() and tensor.numel()):
            continue
        flat = tensor.detach().to("cpu", torch.float64).flatten()
        projection = (flat @ direction(name, flat.numel())).item() / math.sqrt(flat.numel())
        found[name] = (projection, flat.abs().max().item())
    return found


@functools.cache  # made once in a process, for every step and layout
def direction(name: str, size: int) -> torch.Tensor:
    """Tensor `name`'s random direction: normal, from a seed of its name (the same everywhere)."""
    seeded = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(size, generator=seeded, dtype=torch.float64)


def dropouts_off(model: nn.Module) -> None:
    """Dropout layers become identities (not eval mode, which the loop's model.train() undoes)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.modules.dropout._DropoutNd):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, nn.Identity())


@dataclass
class Difference:
    """How far a layout is from the reference, relative."""

    steps: list[float]  # each step's loss difference
    # Each step's weight difference, from the projections (of the tensor's largest weight above
    # 1), and where: the step whose weights first differ is where the layouts part.
    weight_steps: list[tuple[float, str | None]]
    weight: tuple[float, str | None]  # the largest (of the tensor's largest weight above 1), where
    eval_losses: dict[str, float]  # each evaluated split's
    correct: dict[str, int]  # each split's change, shown, not judged: rounding may flip a tie
    failed: str | None = None  # DDP's refusal, if training stopped early
    complete: bool = True  # it trained every step
    drifted: bool = False  # its DDP ranks' parameters differed, which rounding never explains
    monitored: float | None = None  # its checkpoint.monitor value (the layout's own, not a change)

    def within(self, tolerance: float) -> bool:
        worst = max(self.weight[0], *self.steps, *self.eval_losses.values())
        return self.complete and not self.drifted and worst <= tolerance


def compare(trace: Trace, reference: Trace, steps: int, monitor: str = "") -> Difference:
    """How far `trace` is from the reference, and its value of the `monitor` metric."""
    pairs = zip(trace.losses, reference.losses, strict=False)
    weight_steps = [
        max(((abs(a[n][0] - b[n][0]) / max(1.0, b[n][1]), n) for n in b if n in a),
            default=(0.0, None))
        for a, b in zip(trace.projected, reference.projected, strict=False)
    ]  # fmt: skip
    changes = (
        ((a.double() - b.double()).abs().max().item() / max(1.0, b.abs().max().item()), name)
        for name, a in trace.weights.items()
        if (b := reference.weights[name]).is_floating_point() and b.numel()
    )
    # Where the task reports a loss metric, correct counts.
    ours, theirs = trace.evals, reference.evals
    return Difference(
        steps=[abs(a - b) / max(abs(b), 1e-12) for a, b in pairs],
        weight_steps=weight_steps,
        weight=max(changes, default=(0.0, None)),
        eval_losses={s: abs(m[f"{s}/loss"] / theirs[s][f"{s}/loss"] - 1)
                     for s, m in ours.items() if f"{s}/loss" in m},
        correct={s: m[f"{s}/correct"] - theirs[s][f"{s}/correct"]
                 for s, m in ours.items() if f"{s}/correct" in m},
        failed=trace.failed,
        complete=len(trace.losses) == steps and trace.failed is None,
        drifted=trace.drifted is not None and trace.failed is None,
        monitored=ours.get(monitor.partition("/")[0], {}).get(monitor),
    )  # fmt: skip


def table(rows: dict[str, Difference], reference: Trace, monitor: str = "") -> str:
    """The layouts' differences side by side, each one's `monitor` value (the metric that picks
    best.pt), under the reference's correct counts (or loss)."""
    evals = reference.evals
    counted = {s: f"{s}/correct" in metrics for s, metrics in evals.items()}
    shown = any(row.monitored is not None for row in rows.values())  # without a validation: none
    lines = [["layout", "loss (step)", "weights (where)", *([monitor] if shown else [])]]
    lines[0] += [f"{s} correct" if counted[s] else f"{s} loss" for s in evals]
    for name, row in rows.items():
        loss, step = max(((d, step) for step, d in enumerate(row.steps, 1)), default=(0.0, None))
        failed = row.failed and f"failed at {row.failed.split(':')[0]}"
        cells = [failed or f"{loss:.1e} ({step})", "{:.1e} ({})".format(*row.weight)]
        if first := name.endswith("(reference)"):  # its own correct counts (or losses)
            cells = ["-", "-"]
        cells += ["-" if row.monitored is None else f"{row.monitored:.4f}"] * shown
        for s, m in evals.items():
            own = (f"{m.get(f'{s}/correct')}/{m['size']}", f"{m.get(f'{s}/loss', math.nan):.4g}")
            change = (f"{row.correct.get(s, 0):+d}", f"{row.eval_losses.get(s, 0.0):.1e}")
            cells.append((own if first else change)[not counted[s]])
        lines.append([name, *cells])
    widths = [max(map(len, column)) for column in zip(*lines, strict=True)]
    return "\n".join("  ".join(map(str.ljust, line, widths)).rstrip() for line in lines)


def likely_causes(
    layouts: dict[str, Trace],
    rows: dict[str, Difference],
    differ: list[str],
    probed: tuple[nn.Module, Run, tuple],
    processes: DictConfig,
    tolerance: float,
) -> list[str]:
    """What could make the layouts `differ`, from the runs and the one-process model `probed`."""
    reference, strategy = next(iter(layouts.values())), build.build_strategy(processes.parallel)
    norms = [  # those that normalise by this process's batch alone (SyncBatchNorm shares it)
        name
        for name, m in probed[0].named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
    ]
    layers = f"BatchNorm layers ({', '.join(norms[:5])})"
    synced = getattr(strategy, "sync_batchnorm", False)  # FSDP has neither key
    micro = " and each micro-batch" if any("micro-batches" in name for name in differ) else ""
    ddp_buffers = {b for name in differ for b in layouts[name].rank_buffers}
    others = sorted(b for b in ddp_buffers if not b.startswith(tuple(f"{n}." for n in norms)))
    failed = {n: layouts[n].failed for n in differ if layouts[n].failed}
    # After a failure, the ranks' weights are anyone's guess.
    drifted = {n: layouts[n].drifted for n in differ if layouts[n].drifted and n not in failed}
    first, again, other = (gradients(*probed, seed) for seed in (0, 0, 1))
    unrepeatable = not all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    random = not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    worst = max(differ, key=lambda name: rows[name].weight[0])
    where = rows[worst].weight[1]
    causes = {  # each cause, and whether it holds
        **{
            f"{' and '.join(n for n in failed if failed[n] == f)} stopped at {f}": True
            for f in failed.values()
        },
        f"parameters that get no gradient: {', '.join(reference.no_grad[:5])}. DDP with "
        "parallel.find_unused_parameters=false fails on them: set it true (slower), or take "
        "them out of the model": (
            reference.no_grad and not getattr(strategy, "find_unused_parameters", False)
        ),
        f"{layers} normalise each micro-batch by its own statistics, which no setting changes "
        "(parallel.sync_batchnorm=true covers the processes only)": norms and synced,
        f"{layers} normalise each process's share{micro} by its own statistics: "
        "parallel.sync_batchnorm=true shares them between processes (CUDA GPUs), or use "
        "GroupNorm or LayerNorm": norms and not synced,
        "buffers that differ between the DDP processes after a step: "
        f"{', '.join(others[:5])}": others,
        **{
            f"in {name}, rank {rank}'s {parameter} differed from rank 0's after step {step}: "
            "some code changes weights outside the optimizer step, on some ranks only": True
            for name, (step, parameter, rank) in drifted.items()
        },
        "the same step twice gives other gradients: non-deterministic kernels; run with "
        "trainer.deterministic=true": unrepeatable,
        "the model draws random numbers in training (not in a dropout layer, which is off "
        "here): each process draws its own; use a dropout layer, or draw in eval mode only": (
            random and not unrepeatable
        ),
        zero_gradients(reference, where): True,
        course(differ, rows, tolerance, probed[1].trainer.precision == "64"): True,
    }
    return [cause for cause, holds in causes.items() if cause and holds] or [
        f"none this check can see; the largest weight difference is in {where} ({worst})"
    ]


def zero_gradients(reference: Trace, where: str | None) -> str | None:
    """Parameters whose gradient is zero up to rounding, under an optimizer that makes it steps."""
    gradients = reference.gradients
    if not reference.adaptive or not gradients:
        return None
    largest = max(g.max().item() for g in gradients.values())
    # Exactly 0 is the same in every layout, and the optimizer does not move it.
    noise = {n: int(((g > 0) & (g <= ZERO_GRADIENT * largest)).sum()) for n, g in gradients.items()}
    if not (found := [name for name, count in noise.items() if count]):
        return None
    named = ", ".join(f"{n} ({noise[n]} of {gradients[n].numel()})" for n in found[:5])
    there = f"; the largest weight difference is in {where}" if where in found else ""
    return (
        f"parameters whose gradient is zero up to rounding (at most {ZERO_GRADIENT:.0e} of the "
        f"largest, in the reference): {named}{there}. The optimizer divides each gradient by "
        "its own running size, which turns that noise into steps of about the learning rate, "
        "other ones in each layout: rounding, not DDP. Compare in float64 (debug.precision=64, "
        "the default), or leave them out of the model (e.g. bias=False on an attention's key "
        "projection), or raise the optimizer's eps"
    )


def course(
    differ: list[str], rows: dict[str, Difference], tolerance: float, float64: bool
) -> str | None:
    """Where the layouts part from the reference: at step 1's loss (the forward), at the first
    step whose weights differ beyond rounding (the gradients or the update), or at a jump; where
    the weights agree after every step, what differs then (the reported loss, the evaluation)."""
    # A failure, or ranks that drifted apart, is a cause of its own, named above.
    trained = [name for name in differ if not (rows[name].failed or rows[name].drifted)]
    firsts = {n: rows[n].steps[0] for n in trained if rows[n].steps}  # step 1's loss difference
    name = max(firsts, key=firsts.get, default=None)
    if name and (at := firsts[name]) > tolerance:
        return (
            f"in {name} the loss differs from the first step ({at:.1e}): the layouts compute "
            "something else (a sample, a scale, the model's own state), not rounding"
        )
    by_weights = {n: [d for d, _ in rows[n].weight_steps] for n in trained}
    parted = {n: step for n in trained if (step := first_over(by_weights[n], tolerance))}
    if not parted:  # what differs in layouts whose weights agree after every step
        agree = f"the weights agree with the reference's after every step (within {tolerance:.0e})"
        for name in trained:
            if step := first_over(rows[name].steps, tolerance):
                return (
                    f"in {name} {agree}, and the loss of step {step} differs "
                    f"({rows[name].steps[step - 1]:.1e}): what the layouts report as the loss "
                    "differs (a sample, a scale), not what they train"
                )
        for name in trained:
            losses = rows[name].eval_losses
            if (split := max(losses, key=losses.get, default=None)) and losses[split] > tolerance:
                return (
                    f"in {name} {agree}, and its {split} loss differs ({losses[split]:.1e}): the "
                    "evaluation differs (the weights it evaluates, the model's evaluation mode or "
                    "buffers)"
                )
        return None
    name = min(parted, key=lambda n: (parted[n], -by_weights[n][parted[n] - 1]))
    step, by_step = parted[name], rows[name].weight_steps
    (at, where), before = by_step[step - 1], max(by_weights[name][: step - 1], default=0.0)
    by = f"by {at:.1e} against the rounding bound {tolerance:.0e}, in {where}"
    if step > 1 and at >= JUMP * before:
        level = f"to rounding ({before:.0e})" if before else "exactly"
        tipped = (  # float64's rounding tips a tie rarely, and then from rounding's level
            "a near tie (a ReLU, a max) that rounding tipped, carried on by training, or what "
            "that step alone computes otherwise (its batch)"
            if float64
            else "a near tie that rounding tipped, or a difference in what that step computes; "
            "debug.precision=64 tells them apart (in float64 rounding tips ties far more rarely)"
        )
        return (
            f"in {name} the weights agree with the reference's {level} up to step {step - 1} and "
            f"jump at step {step} ({by}): {tipped}"
        )
    grew = f", after a difference that grew from {by_step[0][0]:.0e} at step 1" if step > 1 else ""
    return (
        f"in {name}, the first step whose weights differ (step {step}, {by}){grew}: the layouts "
        "compute other gradients or updates (the loss of step 1 agrees: the forward is the same)"
    )


def first_over(differences: list[float], tolerance: float) -> int | None:
    """The first step whose difference passes `tolerance` (counted from 1), or None."""
    return next((step for step, d in enumerate(differences, 1) if d > tolerance), None)


def probe(cfg: DictConfig, run: Run) -> tuple[nn.Module, Run, tuple]:
    """The config's model as one process builds it, dropout off, its run, and its first batch."""
    model = build.build_model(cfg, run, checkpoint.find_weights(run.settings, run.process))
    model.train()
    dropouts_off(parallel.unwrap(model))
    return model, run, next(run.data.train_batches(1))


def gradients(model: nn.Module, run: Run, batch: tuple, seed: int = 0) -> list[torch.Tensor]:
    """The gradients of the task's loss on one process's `batch`, as training computes them."""
    inputs, targets, task = *batch[:2], run.task
    count = task.count(inputs, targets)  # one process's batch: its own count is the global one
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with run.autocast():
        loss = task.loss(model(inputs), inputs, targets) / count
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]
