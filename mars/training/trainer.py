"""The ``train`` verb: one trainer, two objectives, three stages.

- ``ar``: the clean stream only, ``L = L_AR`` (the AR SFT baseline);
- ``mars``: both streams, ``L = L_mask + w_ar * L_AR`` with block size B.

Stages (params ``train.<stage>``): ``sft`` (AR from the base model), ``mars`` (MARS from the SFT
checkpoint) and ``ar_control`` (AR continued from the SFT checkpoint for as many steps as ``mars``:
the fair baseline). Batches come from :func:`mars.core.batch.build_batch`, the loss from
:func:`mars.core.loss.compute_loss`.

Devices and processes go through accelerate: the same code runs in one CPU process, as several
gloo processes (``accelerate launch --multi_gpu ...`` or ``torchrun``), and on GPUs with DDP, FSDP or
DeepSpeed ZeRO-2 (configs in ``infra/accelerate/``). Results do not depend on the number of processes:

- the data order is a function of (seed, epoch) only; every optimizer step takes the next
  ``batch_size`` examples of the epoch's permutation, split in contiguous slices over processes and
  gradient-accumulation micro-batches;
- each micro-batch's loss is divided by the step's GLOBAL target counts (all-reduced before the
  forward), and scaled back by processes x micro-batches (DDP/FSDP/DeepSpeed average gradients,
  accelerate divides by the accumulation steps), so the summed gradient is the global mean.

Step checkpoints (``<out>/steps``) let a killed run resume where it stopped, and the final model goes to
``<out>/final`` (:mod:`.checkpoints`); each step is a row of the metrics TSV (:mod:`.metrics_log`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import torch

from mars.core.atomic import atomic_dir
from mars.core.batch import DualStreamBatch, build_batch
from mars.core.checkpoint_info import CheckpointInfo
from mars.core.digest import sha256_chunks, sha256_tree
from mars.errors import ConfigError, DataError, MarsError
from mars.core.loss import compute_loss
from mars.core.models import has_bf16_units
from mars.training.checkpoints import load_scheduler_state, resume_from, save_final, save_step
from mars.training.launch import LaunchConfig
from mars.training.metrics_log import MetricsLog, step_summary, write_summary

Stage = Literal["sft", "mars", "ar_control"]
STAGES: tuple[str, ...] = ("sft", "mars", "ar_control")
OBJECTIVE = {"sft": "ar", "mars": "mars", "ar_control": "ar"}


# ----------------------------------------------------------------------------------------- config
@dataclass
class StageConfig:
    """How long one stage trains, and its own learning rate if it differs from ``train.lr``."""

    epochs: float | None = None  # passes over the training split
    max_steps: int | None = None  # wins over epochs when set
    same_steps_as: str | None = None  # train exactly as many steps as that stage (ar_control: mars)
    lr: float | None = None  # null: train.lr
    enabled: bool = True  # sft only: false = an instruction-tuned base is the SFT checkpoint (0 steps)

    def __post_init__(self):
        if self.same_steps_as is not None and self.same_steps_as not in STAGES:
            raise ConfigError(f"same_steps_as: expected one of {', '.join(STAGES)}, got {self.same_steps_as!r}")
        if self.same_steps_as is None and self.epochs is None and self.max_steps is None:
            raise ConfigError("epochs: set epochs, max_steps or same_steps_as")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"epochs: must be > 0, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps: must be >= 1, got {self.max_steps}")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"lr: must be > 0, got {self.lr}")


@dataclass
class MarsStageConfig(StageConfig):
    """The MARS stage also fixes the objective's knobs (recorded in every checkpoint's config.mars)."""

    block_size: int = 4  # B
    w_ar: float = 1.0  # weight of L_AR; 0 is the paper's ablation
    block_offset: Literal["fixed", "random"] = "random"  # random: blocks start at a random shift in [0, B)
    drop_prompt: bool = True  # skip the noisy copy of the prompt (no loss there; ~same result, less compute)
    # L_AR: ce on the data's tokens, or kl from the stage's initial model (frozen; mars.core.loss). ar_control
    # keeps ce: it is the plain fine-tune MARS is compared with.
    ar_loss: Literal["ce", "kl"] = "ce"

    def __post_init__(self):
        super().__post_init__()
        if self.block_size < 1:
            raise ConfigError(f"block_size: must be >= 1, got {self.block_size}")
        if self.w_ar < 0:
            raise ConfigError(f"w_ar: must be >= 0, got {self.w_ar}")


@dataclass
class TrainConfig:
    lr: float = 5e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = 0.03
    max_length: int = 128
    batch_size: int = 16  # GLOBAL examples per optimizer step (all processes x accumulation)
    grad_accum: int = 1
    group_by_length: bool = True  # batches of similar lengths (less padding); the order stays seeded
    max_grad_norm: float | None = 1.0
    # fp32 (accelerate's "no", which YAML and `dvc exp run -S` turn into false) | auto: bf16 where the device has
    # bf16 units | bf16 | fp16
    mixed_precision: Literal["fp32", "no", "auto", "bf16", "fp16"] = "fp32"
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] = "sdpa"
    save_every: int = 100  # optimizer steps between checkpoints
    keep_checkpoints: int = 2
    threads: int | None = 1  # torch CPU threads per process; null: torch's default
    sft: StageConfig = field(default_factory=lambda: StageConfig(epochs=8))
    mars: MarsStageConfig = field(default_factory=lambda: MarsStageConfig(epochs=4, lr=2e-3))
    ar_control: StageConfig = field(default_factory=lambda: StageConfig(same_steps_as="mars", lr=2e-3))
    launch: LaunchConfig = field(default_factory=LaunchConfig)  # processes per stage (mars.training.launch)

    def __post_init__(self):
        checks = {
            "lr": self.lr > 0, "weight_decay": self.weight_decay >= 0, "eps": self.eps > 0,
            "warmup_ratio": 0 <= self.warmup_ratio < 1, "max_length": self.max_length >= 2,
            "batch_size": self.batch_size >= 1, "grad_accum": self.grad_accum >= 1,
            "max_grad_norm": self.max_grad_norm is None or self.max_grad_norm > 0,
            "save_every": self.save_every >= 1, "keep_checkpoints": self.keep_checkpoints >= 1,
            "betas": len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "threads": self.threads is None or self.threads >= 1,
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"{key}: invalid value {getattr(self, key)!r}")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"batch_size: {self.batch_size} is not a multiple of grad_accum={self.grad_accum}")
        if self.mars.block_size > self.max_length:  # a block longer than any example: masks past every response
            raise ConfigError(f"mars.block_size: {self.mars.block_size} is more than max_length={self.max_length}")
        for name in STAGES:
            if name != "sft" and not self.stage(name).enabled:
                raise ConfigError(f"{name}.enabled: only the sft stage can be left out")
            if not self.stage(name).enabled and any(self.stage(o).same_steps_as == name for o in STAGES):
                raise ConfigError(f"{name}.enabled: another stage takes its step count (same_steps_as)")
            seen, stage = {name}, self.stage(name)
            while stage.same_steps_as is not None:
                if stage.same_steps_as in seen:
                    raise ConfigError(f"{name}.same_steps_as: cycle through {stage.same_steps_as}")
                seen.add(stage.same_steps_as)
                stage = self.stage(stage.same_steps_as)

    def stage(self, name: str) -> StageConfig:
        if name not in STAGES:
            raise ConfigError(f"stage: expected one of {', '.join(STAGES)}, got {name!r}")
        return getattr(self, name)

    def schedule_of(self, name: str) -> StageConfig:
        """The stage whose epochs/max_steps decide ``name``'s length (follows same_steps_as)."""
        stage = self.stage(name)
        while stage.same_steps_as is not None:
            stage = self.stage(stage.same_steps_as)
        return stage

    def total_steps(self, name: str, num_examples: int) -> int:
        sched = self.schedule_of(name)
        if sched.max_steps is not None:
            return sched.max_steps
        return max(1, math.ceil(sched.epochs * self.steps_per_epoch(num_examples)))

    def steps_per_epoch(self, num_examples: int) -> int:
        # drop_last: every step has the full global batch, whatever the number of processes
        return num_examples // self.batch_size


# ------------------------------------------------------------------------------------------- data
def load_examples(data_dir: str | Path, max_length: int, split: str = "train") -> tuple[list[dict], dict]:
    """The training examples of a prepared data folder (``mars prepare``) and its meta.json.

    Examples longer than ``max_length`` lose the end of their response; an example whose prompt
    alone fills ``max_length`` has nothing left to learn from and is dropped.
    """
    from mars.training.data import load_meta, load_split

    meta = load_meta(data_dir)
    examples = truncate_examples(load_split(data_dir, split), max_length)
    if not examples:
        raise DataError(f"{data_dir}: split {split!r} has no usable examples (train.max_length={max_length})")
    return examples, meta


def truncate_examples(rows: Sequence[dict], max_length: int) -> list[dict]:
    out = []
    for row in rows:
        ids, p = list(row["input_ids"]), int(row["prompt_len"])
        if p < max_length:
            out.append({"input_ids": ids[:max_length], "prompt_len": p})
    return out


# ---------------------------------------------------------------------------------- data position
class DataOrder:
    """Which examples each optimizer step takes: a function of (seed, epoch, step) only.

    Every epoch is a fresh permutation, cut into global batches (the incomplete last one is
    dropped, so every step has ``batch_size`` examples whatever the number of processes). With
    ``group_by_length``, groups of ``GROUP`` batches are sorted by length before cutting and the
    resulting batches shuffled again: batches hold similar lengths, so less of each is padding.
    """

    GROUP = 32  # batches per length-sorted group

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, group_by_length: bool):
        self.lengths, self.batch_size, self.seed, self.group = list(lengths), batch_size, seed, group_by_length
        self.per_epoch = len(self.lengths) // batch_size
        self._epoch, self._batches = None, []

    def batches(self, epoch: int) -> list[list[int]]:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.lengths), generator=gen).tolist()[: self.per_epoch * self.batch_size]
            if self.group:
                span = self.GROUP * self.batch_size
                order = [i for g in range(0, len(order), span)
                         for i in sorted(order[g:g + span], key=lambda i: -self.lengths[i])]
            cut = [order[k * self.batch_size:(k + 1) * self.batch_size] for k in range(self.per_epoch)]
            if self.group:
                cut = [cut[k] for k in torch.randperm(len(cut), generator=gen).tolist()]
            self._epoch, self._batches = epoch, cut
        return self._batches

    def step(self, step: int) -> tuple[int, list[int]]:
        """(epoch, example indices) of optimizer step ``step`` (0-based)."""
        epoch, j = divmod(step, self.per_epoch)
        return epoch, self.batches(epoch)[j]


def shard(indices: list[int], rank: int, world: int, accum: int) -> list[list[int]]:
    """This process's micro-batches: a contiguous slice of the global batch, cut in ``accum`` parts."""
    per_rank = len(indices) // world
    mine = indices[rank * per_rank:(rank + 1) * per_rank]
    per_micro = per_rank // accum
    return [mine[m * per_micro:(m + 1) * per_micro] for m in range(accum)]


def shard_positions(indices: list[int], rank: int, world: int, accum: int) -> list[tuple[int, list[int]]]:
    """:func:`shard`, each micro-batch with the position of its first example in the global batch."""
    per_micro = len(indices) // (world * accum)
    return [((rank * accum + m) * per_micro, idx) for m, idx in enumerate(shard(indices, rank, world, accum))]


def offset_generator(seed: int, step: int, first: int, block_size: int) -> torch.Generator:
    """The generator ``build_batch`` draws random block offsets from, one per example in order.

    It is the step's generator advanced past the examples of the global batch before this
    micro-batch, so every example gets the offset it would get in one process: random offsets
    depend on neither the number of processes nor gradient accumulation, and a resumed run redraws
    the same ones.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if first:
        torch.randint(0, block_size, (first,), generator=gen)  # the draws build_batch made for earlier examples
    return gen


# ---------------------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    stage: str
    objective: str
    steps: int
    final_dir: Path
    metrics_path: Path
    final_loss: float
    seconds: float
    tokens_per_s: float


class LossModel(torch.nn.Module):
    """The causal LM with the MARS loss as its forward.

    DDP, FSDP and DeepSpeed only synchronise what runs through the wrapped module's own forward;
    ``compute_loss`` calls the decoder and the LM head separately (logits only where there are
    targets), so the whole loss is the forward of this module and the LM is wrapped inside it.
    """

    def __init__(self, lm, attn_implementation: str):
        super().__init__()
        self.lm = lm
        self.attn_implementation = attn_implementation
        self._no_split_modules = getattr(lm, "_no_split_modules", None)  # FSDP auto-wrap reads it

    def forward(self, batch: DualStreamBatch, w_ar: float, denominators: tuple[float, float], teacher=None):
        out = compute_loss(self.lm, batch, w_ar=w_ar, attn_implementation=self.attn_implementation,
                           denominators=denominators, teacher=teacher)
        return out.loss, out.l_mask.detach(), out.l_ar.detach()


def checkpoint_info(cfg: TrainConfig, stage: str, mask_id: int, base: str) -> CheckpointInfo:
    """The ``config.mars`` record of a checkpoint: what it is and how it was trained.

    AR checkpoints record the MARS stage's B too: the block size they are compared at when decoded.
    """
    m = cfg.mars
    objective = OBJECTIVE[stage]
    return CheckpointInfo(block_size=m.block_size, mask_token_id=int(mask_id), objective=objective,
                          w_ar=m.w_ar if objective == "mars" else 1.0, stage=stage,
                          block_offset=m.block_offset if objective == "mars" else "fixed", base=base)


def _make_accelerator(cfg: TrainConfig):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    precision = "no" if cfg.mixed_precision == "fp32" else cfg.mixed_precision
    if precision == "auto":  # bf16 autocast without bf16 units is many times slower than fp32 (AVX2 CPUs)
        precision = "bf16" if has_bf16_units("cuda" if torch.cuda.is_available() else "cpu") else "no"
    # Each run sets its own precision. accelerate keeps one process-wide state and refuses a second
    # Accelerator with another precision, so a second run in one process (a notebook, a test session)
    # would fail; the process group (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    # cpu=True is what makes a multi-process launch on a machine without CUDA use gloo
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=precision,
                       gradient_accumulation_steps=cfg.grad_accum)


def _scheduler(cfg: TrainConfig, optimizer, total: int):
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    warmup = math.ceil(cfg.warmup_ratio * total)
    if cfg.scheduler == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    make = get_cosine_schedule_with_warmup if cfg.scheduler == "cosine" else get_linear_schedule_with_warmup
    return make(optimizer, warmup, total)


# Knobs that may change between a run and its resumption: they do not change what is trained.
OPERATIONAL = ("save_every", "keep_checkpoints", "threads", "grad_accum", "launch")


def init_identity(init: str | Path) -> str:
    """The init checkpoint as a run saw it: a folder's weights and config by digest (a checkpoint rebuilt
    at the same path, the SFT model after `dvc exp run -S train.sft...`, starts another run), else its name."""
    path = Path(init)
    if not path.is_dir():
        return str(init)
    names = [p.name for p in path.iterdir() if p.is_file() and (p.suffix in (".safetensors", ".bin")
                                                                 or p.name == "config.json")]
    return sha256_tree(path, names)


def _fingerprint(cfg: TrainConfig, stage: str, seed: int, init: str, examples: Sequence[dict], total: int) -> dict:
    """What a checkpoint must agree on to be resumed: the run it belongs to (``init``: :func:`init_identity`)."""
    data_sha256 = sha256_chunks(f"{ex['prompt_len']}:{','.join(map(str, ex['input_ids']))};".encode()
                                for ex in examples)
    knobs = {k: v for k, v in asdict(cfg).items() if k not in OPERATIONAL and k not in STAGES}
    return {"stage": stage, "init": init, "seed": seed, "data_sha256": data_sha256, "total_steps": total,
            "train": knobs, "stage_config": asdict(cfg.stage(stage)), "mars_config": asdict(cfg.mars)}


def train(cfg: TrainConfig, *, stage: str, init: str | Path, examples: Sequence[dict], out: str | Path,
          resume: str = "auto", metrics_path: str | Path | None = None, seed: int = 0,
          progress: bool = True, data_meta: dict | None = None) -> TrainResult:
    """Train ``stage`` from the checkpoint ``init`` on ``examples``; the final model goes to ``out/final``.

    ``data_meta`` (the prepared data's meta.json) is checked against the tokenizer of ``init``.
    """
    from accelerate.utils import set_seed

    from mars.core.mask_token import mask_token_id
    from mars.core.models import load_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    stage_cfg = cfg.stage(stage)
    objective = OBJECTIVE[stage]
    out = Path(out)
    metrics_path = Path(metrics_path) if metrics_path else Path("metrics") / f"train_{stage}.tsv"
    accelerator = _make_accelerator(cfg)
    if not stage_cfg.enabled:
        return _init_as_final(accelerator, cfg, stage, init, out, metrics_path, seed)
    world, rank, main = accelerator.num_processes, accelerator.process_index, accelerator.is_main_process
    if cfg.batch_size % (world * cfg.grad_accum):
        raise ConfigError(f"train.batch_size: {cfg.batch_size} is not a multiple of processes x grad_accum "
                          f"= {world} x {cfg.grad_accum}")
    n = len(examples)
    if n < cfg.batch_size:
        raise DataError(f"{n} training examples, fewer than one batch (train.batch_size={cfg.batch_size})")
    total = cfg.total_steps(stage, n)
    per_epoch = cfg.steps_per_epoch(n)
    set_seed(seed)

    model, tokenizer = load_model(init, attn_implementation=cfg.attn_implementation)
    mask_id = mask_token_id(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise MarsError(f"{init}: tokenizer has neither a pad nor an EOS token")
    if data_meta is not None:
        from mars.training.data import check_tokenizer

        check_tokenizer(data_meta, tokenizer)  # the data's token ids must mean the same here
    init_info = CheckpointInfo.from_config(model.config)
    base = init_info.base if init_info is not None and init_info.base else str(init)
    teacher = None
    if objective == "mars" and cfg.mars.ar_loss == "kl":
        # a plain frozen copy, outside what accelerate wraps: nothing of it is trained or synchronised
        teacher, _ = load_model(init, attn_implementation=cfg.attn_implementation)
        teacher = teacher.eval().requires_grad_(False).to(accelerator.device)
    model = LossModel(model.train(), cfg.attn_implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=stage_cfg.lr or cfg.lr, betas=tuple(cfg.betas),
                                  eps=cfg.eps, weight_decay=cfg.weight_decay)
    # The scheduler stays outside prepare(): accelerate would step it once per process per step.
    scheduler = _scheduler(cfg, optimizer, total)
    model, optimizer = accelerator.prepare(model, optimizer)

    # the init's digest reads every weight file: the main process hashes it once for all ranks
    identity = [init_identity(init) if main else None]
    if world > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(identity)
    fingerprint = _fingerprint(cfg, stage, seed, identity[0], examples, total)
    start = 0
    resumed = resume_from(resume, out, fingerprint, stage, main)
    if resumed is not None:
        ckpt, state = resumed
        load_scheduler_state(scheduler, ckpt, state)  # first: a state it refuses stops before the weights load
        accelerator.load_state(str(ckpt))
        start = int(state["step"])
    elif main and (out / "steps").exists():
        shutil.rmtree(out / "steps")  # a fresh run must never be resumed into later from stale steps
    if main:
        # the steps folder is a declared (persistent) DVC output: it exists even when no step was saved
        (out / "steps").mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()

    log = MetricsLog(metrics_path, start) if main else None
    bar = None
    if main and progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=start, desc=f"train {stage}", unit="step", dynamic_ncols=True)
    m = cfg.mars
    order = DataOrder([len(e["input_ids"]) for e in examples], cfg.batch_size, seed, cfg.group_by_length)
    scale = world * cfg.grad_accum
    device = accelerator.device
    started, tokens_seen, last = time.perf_counter(), 0, {}
    try:
        for step in range(start, total):
            t0 = time.perf_counter()
            epoch, indices = order.step(step)
            batches = []
            for first, idx in shard_positions(indices, rank, world, cfg.grad_accum):
                batches.append(build_batch([examples[i] for i in idx], objective=objective,
                                           block_size=m.block_size, mask_token_id=mask_id, pad_token_id=pad_id,
                                           block_offset=m.block_offset, drop_prompt=m.drop_prompt,
                                           generator=offset_generator(seed, step, first, m.block_size)).to(device))
            counts = torch.tensor([[b.num_targets()["mask"], b.num_targets()["ar"], int(b.layout.valid.sum())]
                                   for b in batches], dtype=torch.float64, device=device).sum(0)
            counts = accelerator.reduce(counts, reduction="sum")
            denominators = (float(counts[0]), float(counts[1]))
            w_ar = m.w_ar if objective == "mars" else 1.0
            l_mask = l_ar = 0.0
            for batch in batches:
                with accelerator.accumulate(model), accelerator.autocast():
                    loss_t, l_mask_t, l_ar_t = model(batch, w_ar, denominators, teacher)
                    accelerator.backward(loss_t * scale)
                    if accelerator.sync_gradients and cfg.max_grad_norm:
                        accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                l_mask += float(l_mask_t)
                l_ar += float(l_ar_t)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            summed = accelerator.reduce(torch.tensor([l_mask, l_ar], dtype=torch.float64, device=device), "sum")
            l_mask, l_ar = float(summed[0]), float(summed[1])
            loss = l_mask + w_ar * l_ar if objective == "mars" else l_ar
            elapsed = time.perf_counter() - t0
            tokens_seen += int(counts[2])
            last = {"step": step + 1, "epoch": round(epoch + (step % per_epoch + 1) / per_epoch, 4), "loss": loss,
                    "l_mask": l_mask, "l_ar": l_ar, "lr": lr, "tokens_per_s": float(counts[2]) / max(elapsed, 1e-9)}
            if not math.isfinite(loss):
                raise MarsError(f"train {stage}: loss is {loss} at step {step + 1} (lower train.lr?)")
            if log is not None:
                log.write(last)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", l_mask=f"{l_mask:.4f}", l_ar=f"{l_ar:.4f}",
                                tok_s=f"{last['tokens_per_s']:.0f}", refresh=False)
            if (step + 1) % cfg.save_every == 0 and step + 1 < total:
                save_step(accelerator, out, step + 1, fingerprint, scheduler.state_dict(), cfg.keep_checkpoints)
    finally:
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    seconds = time.perf_counter() - started
    final = out / "final"
    save_final(accelerator, model, tokenizer, final, checkpoint_info(cfg, stage, mask_id, base), {
        "stage": stage, "objective": objective, "init": str(init), "steps": total, "seed": seed,
        "num_examples": n, "processes": world, "train": asdict(cfg),
        "final_step": step_summary(last),  # no throughput: the same run writes the same bytes
    })
    if main:
        write_summary(metrics_path, last)
    return TrainResult(stage=stage, objective=objective, steps=total, final_dir=final, metrics_path=metrics_path,
                       final_loss=float(last.get("loss", float("nan"))), seconds=seconds,
                       tokens_per_s=tokens_seen / max(seconds, 1e-9))


def _init_as_final(accelerator, cfg: TrainConfig, stage: str, init, out: Path, metrics_path: Path,
                   seed: int) -> TrainResult:
    """A stage left out (``train.sft.enabled: false``): ``init`` is its final model, after 0 steps.

    The checkpoint gets the ``config.mars`` record an AR checkpoint has (its mask token, the B it is
    decoded at), the metrics file a header, the steps folder exists: downstream stages read it alike.
    """
    from mars.core.mask_token import mask_token_id
    from mars.core.models import load_model

    if accelerator.is_main_process:
        model, tokenizer = load_model(init)
        info = checkpoint_info(cfg, stage, mask_token_id(model, tokenizer), str(init))
        info.write_to(model.config)
        with atomic_dir(out / "final") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "mars_run.json").write_text(json.dumps(
                {"stage": stage, "objective": OBJECTIVE[stage], "init": str(init), "steps": 0, "seed": seed,
                 "skipped": f"train.{stage}.enabled is false: {init} is the {stage} checkpoint",
                 "mars": info.to_dict()}, indent=2))
        if (out / "steps").exists():
            shutil.rmtree(out / "steps")
        (out / "steps").mkdir(parents=True)
        MetricsLog(metrics_path, 0).close()
        write_summary(metrics_path, {})
    accelerator.wait_for_everyone()
    return TrainResult(stage=stage, objective=OBJECTIVE[stage], steps=0, final_dir=out / "final",
                       metrics_path=metrics_path, final_loss=float("nan"), seconds=0.0, tokens_per_s=0.0)
