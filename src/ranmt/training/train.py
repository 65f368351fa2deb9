"""The training loop, explicit from top to bottom (nanoGPT style).

``train(cfg, data_dir, run_dir)``: token-bucketed batches, Adam (0.9, 0.98) with linear
warm-up and inverse-square-root decay, label-smoothed cross-entropy, gradient
accumulation and clipping, autocast (bf16/fp16) on CUDA, validation loss and greedy BLEU
every ``validate_every`` steps, best-by-BLEU and last-K checkpoints, early stopping,
``max_steps`` / ``max_epochs`` / ``max_time`` limits, exact resume (model, optimizer,
schedule, RNG, epoch and batch position), TensorBoard scalars and a progress bar.

Loss (:mod:`ranmt.training.loss`): what ``F.cross_entropy(..., label_smoothing=eps)`` gives,
i.e. for a target y and V classes ``(1 - eps) * (-log p_y) + eps * mean_v(-log p_v)``,
summed over non-pad target tokens, as one fused autograd function.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ranmt.checkpoint import (
    load_checkpoint,
    load_training_state,
    resolve_checkpoint,
    save_checkpoint,
    step_checkpoints,
)
from ranmt.config import (
    VALID_METRIC_NAMES,
    Config,
    ConfigError,
    decode_with,
    from_dict,
    parse_duration,
    save_yaml,
    to_dict,
)
from ranmt.data.batching import (
    BatchPrefetcher,
    ShapeBuckets,
    batch_from_split,
    make_batches,
    padding_share,
    rank_plan,
)
from ranmt.data.corpus import (
    EncodedSplit,
    SubsetSequences,
    fill_config_from_data,
    load_split,
    raw_text,
)
from ranmt.data.shapes import choose_shapes
from ranmt.data.vocab import Vocab
from ranmt.evaluate import score
from ranmt.inference.translator import Translator
from ranmt.model import build_model, count_parameters
from ranmt.runtime.dropout import fast_masks
from ranmt.runtime.memory import cap_onednn_primitive_cache, retain_freed_memory
from ranmt.runtime.precision import PrecisionPolicy, legacy_precision
from ranmt.runtime.signals import RunningClock
from ranmt.training.deferred import DeviceTally
from ranmt.training.distributed import (
    all_reduce_sum,
    barrier,
    broadcast_object,
    hold_until_exit,
    init_distributed,
    shutdown,
)
from ranmt.training.loss import label_smoothed_loss, teacher_forced_loss
from ranmt.training.master import MasterWeights


def inverse_sqrt_lr(step: int, peak: float, warmup: int, init: float = 0.0) -> float:
    """Learning rate for optimizer step ``step`` (1-based).

    Linear from ``init`` to ``peak`` over ``warmup`` steps, then ``peak * sqrt(warmup/step)``.
    With ``warmup == 0`` the rate is constant ``peak``.
    """
    if warmup <= 0:
        return peak
    if step <= warmup:
        return init + (peak - init) * step / warmup
    return peak * math.sqrt(warmup / step)


class _StopSignal:
    """Turns SIGTERM/SIGINT into a flag so the loop can save and exit cleanly."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not in the main thread
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class NullLogger:
    """The logger of ranks other than 0: they write nothing."""

    def line(self, text: str) -> None:
        pass

    def scalars(self, step: int, values: dict) -> None:
        pass

    def close(self) -> None:
        pass


class Logger:
    def __init__(self, run_dir: Path, use_tensorboard: bool):
        self.file = open(run_dir / "train.log", "a", encoding="utf-8")  # noqa: SIM115
        self.writer = None
        if use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                self.line("tensorboard is not installed; scalars are not written")

    def line(self, text: str) -> None:
        tqdm.write(text, file=sys.stderr)
        self.file.write(text + "\n")
        self.file.flush()

    def scalars(self, step: int, values: dict) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


@torch.no_grad()
def validate(model, valid, cfg: Config, device, policy: PrecisionPolicy,
             translator: Translator | None, references: list[str], note=None) -> dict:
    """Validation loss/perplexity and (optionally) the greedy decode's ``valid_METRIC``
    (``train.valid_metric``, default BLEU); the forward passes run in the training steps'
    regime (``policy.forward()``); ``note`` (a function of one line, default stderr) gets
    what the caller should know (e.g. truncated pairs)."""
    model.eval()
    total_loss = total_nll = total_tokens = 0.0
    lengths = np.array([len(s) for s in valid.src]), np.array([len(t) for t in valid.tgt])
    for indices in make_batches(*lengths, cfg.data.max_tokens):
        batch = batch_from_split(valid, indices, cfg.model.max_positions).to(device)
        with policy.forward():
            logits = model(batch.src, batch.tgt_in)
        loss, nll = label_smoothed_loss(logits, batch.tgt_out, cfg.train.label_smoothing)
        total_loss += float(loss)
        total_nll += float(nll)
        total_tokens += batch.target_tokens
    limit = cfg.model.max_positions - 1
    truncated = sum(1 for s, t in zip(valid.src, valid.tgt) if len(s) > limit or len(t) > limit)
    if truncated:
        message = (f"note: {truncated} validation pair(s) longer than {limit} subwords were "
                   "truncated for the validation loss")
        (note or (lambda line: tqdm.write(line, file=sys.stderr)))(message)
    result = {"valid_loss": total_loss / total_tokens,
              "valid_nll": total_nll / total_tokens,
              "valid_ppl": math.exp(min(total_nll / total_tokens, 50))}
    if translator is not None:
        limit = cfg.train.valid_max_sentences or len(valid)
        ids = [list(map(int, s)) for s in valid.src[:limit]]
        hyps = translator.translate_ids(ids)
        text = translator.tgt_vocab.decode([h[0][0] for h in hyps])
        metric = cfg.train.valid_metric
        result[f"valid_{metric}"] = score(text, references[:limit], metrics=(metric,))[metric]
    model.train()
    return result


def allow_recompiles(shapes: int) -> None:
    """Let Dynamo compile a frame for ``shapes`` static shapes: past its recompile limit (8
    by default) it runs the frame eagerly, so a 9th bucket would never be compiled (as
    measured: benchmarks/compile_buckets.py, 10 buckets, 8 graphs and a warning)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # newer / older torch
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), shapes))


FILL_KEYS = ("src_tokens", "src_slots", "tgt_tokens", "tgt_slots")
"""The log window's counts of real tokens and padded slots per side (``Batch.fill``)."""
INTEGER_KEYS = ("tokens", *FILL_KEYS)


def fill_text(window: dict) -> str:
    """``fill 93.2% (src 92.0%, tgt 94.4%)``: the share of the batches' slots (sentences x
    padded length, both sides) that real tokens fill, over a log window's batches."""
    def share(tokens: int, slots: int) -> str:
        return f"{100 * tokens / max(slots, 1):.1f}%"

    total = share(window["src_tokens"] + window["tgt_tokens"],
                  window["src_slots"] + window["tgt_slots"])
    return (f"fill {total} (src {share(window['src_tokens'], window['src_slots'])}, "
            f"tgt {share(window['tgt_tokens'], window['tgt_slots'])})")


def compiled_forward_loss(t, buckets: ShapeBuckets | None, distributed: bool):
    """The step's forward and loss (:func:`teacher_forced_loss`), through ``torch.compile``
    when ``train.compile``: one graph for forward + loss (+ their backward), traced with
    ``fullgraph=True`` (a graph break is an error, not a silent eager fallback; under DDP
    Dynamo splits the graph at the gradient buckets, so not there), one static graph per
    shape bucket (``dynamic=False``) or automatic dynamic shapes without buckets."""
    if not t.compile:
        return teacher_forced_loss
    if buckets is not None:
        allow_recompiles(len(buckets) + 1)
    return torch.compile(teacher_forced_loss, mode=t.compile_mode, fullgraph=not distributed,
                         dynamic=False if buckets is not None else None)


def _latest_training_checkpoint(run_dir: Path) -> Path | None:
    steps = step_checkpoints(run_dir)
    return steps[-1] if steps else None


class TrainingRun:
    """One training run as a recipe that reads top to bottom (torchtune style).

    ``__init__`` sets everything up (config from the data, device, model and optimizer,
    resumed state, data, validation, logging); :meth:`run` loops over epochs and
    :meth:`optimizer_step` until a budget or a signal stops it, validating and
    checkpointing every ``train.validate_every`` steps; :meth:`finish` validates and saves
    the last step and writes ``summary.json``.
    """

    def __init__(self, cfg: Config, data_dir: str | Path, run_dir: str | Path):
        self.clock = RunningClock()  # monotonic, less the time the process was stopped
        self.created = self.clock.now()
        self.seconds_to_first_step: float | None = None  # set-up + this process's 1st step
        self.cfg, self.t = cfg, cfg.train
        self.data_dir, self.run_dir = Path(data_dir), Path(run_dir)
        self.notes: list[str] = []  # set-up notes, written to train.log once it is open
        self._setup_config_from_data()
        self._setup_device()
        self._setup_model_and_optimizer()
        self._setup_data()
        self._setup_logging()

    # ---- setup
    def _setup_config_from_data(self) -> None:
        """Vocabulary sizes and gamma come from the prepared data's meta.json."""
        fill_config_from_data(self.cfg, self.data_dir)
        self.vocab_files = {"src": self.data_dir / "spm.src.model",
                            "tgt": self.data_dir / "spm.tgt.model"}

    def _setup_device(self) -> None:
        self.ctx, self.device = init_distributed(self.t.device)
        if self.t.threads > 0:
            torch.set_num_threads(self.t.threads)
        if self.device.type == "cpu":
            retain_freed_memory()  # no page faults on every step's large buffers (memory.py)
            cap_onednn_primitive_cache()  # bf16: 16 cached primitives, not 1,024 (memory.py)
        torch.manual_seed(self.t.seed)

    def _setup_model_and_optimizer(self) -> None:
        """Build (or load the latest step checkpoint of) the model; Adam; the RNG state."""
        cfg, device, run_dir = self.cfg, self.device, self.run_dir
        self.resume_from = _latest_training_checkpoint(run_dir)
        self.state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "elapsed": 0.0,
                      "best_bleu": None, "best_step": None, "bad_validations": 0,
                      "nonfinite_skipped": 0, "validations": []}
        if self.resume_from is not None:
            model = self._resumed_model()
        else:
            model = build_model(cfg.model).to(device)
        self._setup_precision()
        self._setup_valid_metric()
        model.train()
        self.model = model
        trained = self._trained_parameters()  # before DDP: it may turn the weights to bf16
        if self.ctx.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            save_yaml(cfg, run_dir / "config.yaml")
        # The model used for training steps: DDP-wrapped across ranks. Checkpoints,
        # validation and decoding always use the plain `model`.
        self.step_model = self.ddp_model = model
        if self.ctx.enabled:
            self.step_model = self.ddp_model = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
            hold_until_exit(self.ddp_model)  # never freed: a deadlock in gloo (its docstring)
        t = self.t
        self.deferred = self._reads_deferred()
        fused = bool(self.policy.fused_optimizer or self.deferred)
        self.optimizer = torch.optim.Adam(trained, lr=t.lr,
                                          betas=tuple(t.adam_betas), eps=t.adam_eps,
                                          weight_decay=t.weight_decay, fused=fused or None,
                                          foreach=None if fused else True)
        if self.resume_from is not None:
            self._restore_optimizer_and_rng()
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.policy.loss_scaling)

    def _trained_parameters(self) -> list:
        """What the optimizer updates: the model's parameters, or, with a bf16 compute copy
        (``train.precision=bf16-weights``), the fp32 master weights behind them."""
        self.masters = None
        if self.policy.weights_dtype is None:
            return list(self.model.parameters())
        self.masters = MasterWeights(self.model, self.policy.weights_dtype)
        return self.masters.parameters()

    def fp32_weights(self):
        """The context in which the model has its fp32 weights (checkpoints, validation)."""
        return contextlib.nullcontext() if self.masters is None else self.masters.fp32_weights()

    def _reads_deferred(self) -> bool:
        """Whether the host reads the steps' results only at log steps (train.host_reads:
        ``auto`` defers on CUDA; never with fp16, whose loss scaler reads every step)."""
        mode = self.t.host_reads
        deferred = self.device.type == "cuda" if mode == "auto" else mode == "log"
        if deferred and self.policy.loss_scaling:
            self.notes.append("note: fp16 reads every step's loss (train.host_reads=step): "
                              "its loss scaler checks each step")
            return False
        return deferred

    # ---- resuming (the resume path: these two, _latest_training_checkpoint, checkpoint)
    def _resumed_model(self) -> torch.nn.Module:
        """The model of the newest step checkpoint; its trainer state into ``self.state``;
        the model config stored there replaces the given one (with a note) if they differ."""
        model, saved_cfg, saved_meta, _ = load_checkpoint(self.resume_from, self.device)
        if to_dict(saved_cfg.model) != to_dict(self.cfg.model):
            self.notes.append(f"note: resuming {self.run_dir} with the model config stored in "
                              "its checkpoint")
            self.cfg.model = from_dict({"model": to_dict(saved_cfg.model)}).model
        self.state.update(saved_meta["trainer"])
        return model

    def _restore_optimizer_and_rng(self) -> None:
        """Adam's moments and step counts, and the RNG states, as the checkpoint saved them."""
        optim_state, extra = load_training_state(self.resume_from)
        self.optimizer.load_state_dict(optim_state)
        torch.set_rng_state(extra["cpu_rng"])
        if self.device.type == "cuda" and "cuda_rng" in extra:
            torch.cuda.set_rng_state(extra["cuda_rng"], self.device)

    def _setup_valid_metric(self) -> None:
        """The score that picks the best checkpoint, kept in the trainer state like the
        precision: a resumed run goes on comparing what it compared (runs started before
        the field: BLEU); the loss where the validation set is not decoded."""
        wanted = self.t.valid_metric if self.t.validate_bleu else "loss"
        recorded = self.state.get("valid_metric")
        if recorded is None and self.resume_from is not None:
            recorded = "bleu" if self.t.validate_bleu else "loss"
        if recorded is not None and recorded != wanted:
            if "loss" in (recorded, wanted):
                raise ConfigError(f"{self.run_dir} started with the best checkpoint chosen by "
                                  f"{recorded}, not {wanted}: set train.validate_bleu as it "
                                  "started or train in a new folder")
            self.notes.append(f"note: resuming {self.run_dir} with train.valid_metric="
                              f"{recorded} (as the run started; not {wanted})")
            self.t.valid_metric = recorded
        self.state["valid_metric"] = recorded or wanted

    def _setup_precision(self) -> None:
        """The run's precision: resolved once when it starts (``auto`` by the hardware,
        :mod:`ranmt.runtime.precision`) and kept in the trainer state, so that a resumed run goes on
        in the precision it started in, on any machine."""
        recorded = self.state.get("precision")
        if recorded is not None:
            self.policy = PrecisionPolicy(recorded, self.device.type, "as the run started")
        elif self.resume_from is not None:  # started before the precision was recorded
            self.policy = PrecisionPolicy(legacy_precision(self.t.precision, self.device),
                                          self.device.type,
                                          "as the run started, before CPUs trained in bf16")
        else:
            self.policy = PrecisionPolicy.resolve(self.t.precision, self.device)
        self.precision = self.state["precision"] = self.policy.name
        self.policy.configure_matmuls()

    def _setup_data(self) -> None:
        """Training pairs (too long ones skipped), validation split, references, translator."""
        cfg = self.cfg
        train_split = load_split(self.data_dir, "train")
        self.valid_split = load_split(self.data_dir, "valid")
        self.references = raw_text(self.data_dir, "valid", "tgt")
        src_lens, tgt_lens = train_split.lengths()
        too_long = (src_lens >= cfg.model.max_positions) | (tgt_lens >= cfg.model.max_positions)
        if too_long.any():
            # Data prepared with a larger --max-positions than the model's N: skip, say so.
            keep = np.flatnonzero(~too_long)
            self.notes.append(f"note: {int(too_long.sum())} training pair(s) longer than "
                              f"model.max_positions-1 = {cfg.model.max_positions - 1} "
                              "subwords are skipped")
            train_split = EncodedSplit(SubsetSequences(train_split.src, keep),
                                       SubsetSequences(train_split.tgt, keep))
            src_lens, tgt_lens = src_lens[keep], tgt_lens[keep]
        self.train_split, self.src_lens, self.tgt_lens = train_split, src_lens, tgt_lens
        self.buckets = self._shape_buckets()
        self.forward_loss = compiled_forward_loss(self.t, self.buckets, self.ctx.enabled)
        self.translator = None
        if cfg.train.validate_bleu:
            self.translator = Translator(self.model, cfg, Vocab(self.vocab_files["src"]),
                                         Vocab(self.vocab_files["tgt"]), self.device)
            self.translator.decode_config = decode_with(cfg.decode, beam=1, nbest=1,
                                                        truncate_long=True, sampling="none")

    def _setup_logging(self) -> None:
        ctx, t = self.ctx, self.t
        self.log = Logger(self.run_dir, t.tensorboard) if ctx.is_main else NullLogger()
        for note in self.notes:
            self.log.line(note)
        self.params = count_parameters(self.model)
        self.log.line(
            f"ranmt train: {self.params['total']:,} parameters, device {self.device}, "
            f"precision {self.policy.describe()}, "
            f"{len(self.train_split)} training pairs"
            + (f", {ctx.world_size} processes (effective batch: data.max_tokens x "
               f"{ctx.world_size} x train.accumulation)" if ctx.enabled else "")
            + (f", resuming from {self.resume_from.name}" if self.resume_from else "")
            + (f", the host reads losses every {t.log_every} steps (train.host_reads=log)"
               if self.deferred else ""))
        if self.cfg.data.auto_shape_buckets:
            self.log.line(f"data.auto_shape_buckets: {len(self.buckets)} shapes chosen from the "
                          "training lengths (sentences x source/target length): "
                          f"{self.buckets.describe()}")
        if ctx.is_main:
            (self.run_dir / "parameters.json").write_text(json.dumps(self.params, indent=1))
        self.max_time = parse_duration(t.max_time)
        self.step, self.epoch = self.state["step"], self.state["epoch"]
        self.first_step = self.step  # where this process started (0, or the resumed step)
        self.batch_index = self.state["batch_in_epoch"]
        self.start_time = self.clock.now() - self.state["elapsed"]
        self.window = {"loss": 0.0, "nll": 0.0, "tokens": 0, "time": 0.0, "steps": 0,
                       **dict.fromkeys(FILL_KEYS, 0)}
        self.data_wait = 0.0  # seconds spent building batches in the current log window
        self.total_tokens, self.total_train_time = 0, 0.0
        self.nonfinite_in_a_row = 0
        self.tally = DeviceTally(self.device) if self.deferred else None
        self.window_clock: float | None = None  # deferred reads: when the window's steps began
        self.last_validated = self.step if self.resume_from is not None else -1
        self.stop_reason: str | None = None
        self.progress = tqdm(total=t.max_steps or None, initial=self.step,
                             # a bar on a terminal only: redirected to a file, its
                             # carriage-return frames would fill the log (the log lines
                             # still reach stderr)
                             disable=not t.progress or not ctx.is_main
                             or not sys.stderr.isatty(), unit="step",
                             dynamic_ncols=True, mininterval=2.0, file=sys.stderr)

    # ---- the loop
    def run(self) -> dict:
        """Train until a budget, early stopping or a signal; return the summary."""
        if self.resume_from is not None:  # a finished run resumed with the same budget
            self.stop_reason = self._budget_reached(out_of_time=self._out_of_time())
        with _StopSignal() as self.stop_signal, self.clock:
            while self.stop_reason is None:
                if self.t.max_epochs and self.epoch >= self.t.max_epochs:
                    self.stop_reason = f"max_epochs={self.t.max_epochs} reached"
                    break
                self.run_epoch()
            self.finish()
        return self.summary()

    def run_epoch(self) -> None:
        """The rest of the current epoch: optimizer steps from ``batch_index`` on."""
        ctx, t = self.ctx, self.t
        batches = make_batches(self.src_lens, self.tgt_lens, self.cfg.data.max_tokens,
                               self.cfg.data.max_sentences, seed=t.seed, epoch=self.epoch,
                               noise=self.cfg.data.bucket_noise, buckets=self.buckets,
                               pool=self.cfg.data.pool_batches)
        if self.buckets is not None and self.batch_index == 0:
            self._log_shapes(batches)
        per_step = ctx.world_size * t.accumulation
        plan = rank_plan(batches, self.batch_index, ctx.world_size, ctx.rank, t.accumulation)
        # a worker builds the batches
        prefetcher = BatchPrefetcher(self.train_split, plan, buckets=self.buckets,
                                     pin=self.device.type == "cuda")
        try:
            while len(batches) - self.batch_index >= ctx.world_size:
                group = batches[self.batch_index: self.batch_index + per_step][
                    ctx.rank::ctx.world_size]
                self.batch_index += min(per_step, len(batches) - self.batch_index)
                if not self.optimizer_step(group, prefetcher):
                    if self.stop_reason is not None:
                        break
                    continue
                self._after_step()
                if self.stop_reason is not None:
                    break
        finally:
            prefetcher.close()
        if self.stop_reason is None:
            self.epoch += 1
            self.batch_index = 0

    def _shape_buckets(self) -> ShapeBuckets | None:
        """data.shape_buckets as given, or data.auto_shape_buckets shapes chosen from the
        training lengths (the same on every rank and at every resume: the data decide)."""
        data, max_positions = self.cfg.data, self.cfg.model.max_positions
        if data.auto_shape_buckets:
            shapes = choose_shapes(self.src_lens + 1, self.tgt_lens + 1, data.auto_shape_buckets,
                                   data.max_tokens, data.max_sentences, max_positions)
        elif data.shape_buckets:
            shapes = list(data.shape_buckets)
        else:
            return None
        return ShapeBuckets(shapes, data.max_tokens, data.max_sentences, max_positions)

    def _log_shapes(self, batches: list) -> None:
        """The epoch's batch shapes and their padding (shape buckets)."""
        shapes = {self.buckets.batch_shape(int(self.src_lens[b].max()) + 1,
                                           int(self.tgt_lens[b].max()) + 1) for b in batches}
        padded = padding_share(batches, self.src_lens, self.tgt_lens, self.buckets)
        data, t = self.cfg.data, self.t
        plain = padding_share(make_batches(self.src_lens, self.tgt_lens, data.max_tokens,
                                           data.max_sentences, seed=t.seed, epoch=self.epoch,
                                           noise=data.bucket_noise, pool=data.pool_batches),
                              self.src_lens, self.tgt_lens)
        self.log.line(f"epoch {self.epoch + 1}: {len(batches)} batches in {len(shapes)} "
                      f"shapes (shape buckets), padding {padded:.1%} of the batch slots "
                      f"({plain:.1%} without buckets)")

    def optimizer_step(self, group: list, prefetcher: BatchPrefetcher) -> bool:
        """Forward/backward over the step's batches, then one update; False if skipped."""
        ctx, device = self.ctx, self.device
        step_start = self.clock.now()
        self.optimizer.zero_grad(set_to_none=True)
        if self.masters is not None:
            self.masters.zero_grad()
        local_tokens = sum(int((self.tgt_lens[b] + 1).sum()) for b in group)
        group_tokens = int(all_reduce_sum([local_tokens], ctx, device)[0])
        # DDP averages gradients over ranks: scale so the result is the sum of all ranks'
        # losses over all their target tokens (equal to one big batch).
        loss_scale = ctx.world_size / group_tokens
        local_loss = local_nll = 0.0
        on_device = []  # deferred reads: each batch's (loss, nll) sums (2,)
        for position, indices in enumerate(group):
            wait_start = self.clock.now()
            batch = next(prefetcher)
            assert batch.indices is indices, "batch plan out of step"
            for key, count in zip(FILL_KEYS, batch.fill()):  # on the host, before the copy
                self.window[key] += count
            batch = batch.to(device)
            self.data_wait += self.clock.now() - wait_start
            last = position == len(group) - 1
            # accumulate locally; all-reduce only with the group's last backward
            sync = contextlib.nullcontext() if (last or not ctx.enabled) \
                else self.ddp_model.no_sync()
            with sync:
                with self.policy.forward(), fast_masks(self.t.dropout_masks == "fast"):
                    loss, nll = self.forward_loss(self.step_model, batch.src, batch.tgt_in,
                                                  batch.tgt_out, self.t.label_smoothing)
                self.scaler.scale(loss * loss_scale).backward()
            if self.deferred:
                on_device.append(torch.stack([loss.detach().float(), nll.detach().float()]))
            else:
                local_loss += float(loss.detach())
                local_nll += float(nll)
        if self.deferred:
            return self._deferred_update(sum(on_device), group_tokens, step_start)
        group_loss, group_nll = all_reduce_sum([local_loss, local_nll], ctx, device)
        if not math.isfinite(group_loss):
            self._skip_nonfinite()
            return False
        self.nonfinite_in_a_row = 0
        self._update()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed_step = self.clock.now() - step_start
        for key, value in (("loss", group_loss), ("nll", group_nll), ("tokens", group_tokens),
                           ("time", elapsed_step), ("steps", 1)):
            self.window[key] += value
        self.total_tokens += group_tokens
        self.total_train_time += elapsed_step
        self.progress.update(1)
        return True

    def _update(self) -> None:
        """The optimizer update of the accumulated gradients (learning rate of the next
        step, unscaling, clipping), and the step count."""
        t = self.t
        self.lr = inverse_sqrt_lr(self.step + 1, t.lr, t.warmup_steps, t.warmup_init_lr)
        for group_params in self.optimizer.param_groups:
            group_params["lr"] = self.lr
        if self.masters is not None:
            self.masters.to_master()
        self.scaler.unscale_(self.optimizer)
        if t.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.masters.parameters() if self.masters
                                           else self.model.parameters(), t.clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.masters is not None:
            self.masters.to_model()
        self.step += 1

    def _deferred_update(self, step_sums, group_tokens: int, step_start: float) -> bool:
        """``train.host_reads=log``: the update with nothing read on the host. The step's
        (loss, nll) sums (2,) stay on the device (summed over ranks there); a non-finite
        loss skips the update inside fused Adam (its ``found_inf``), and the tallies are
        read at the next log step (:meth:`_read_tallies`)."""
        if self.ctx.enabled:
            torch.distributed.all_reduce(step_sums)
        skip = self.tally.nonfinite(step_sums)  # 0-dim float32 on the device
        self.optimizer.found_inf = skip
        try:
            self._update()
        finally:
            del self.optimizer.found_inf
        self.tally.add(step_sums, skip, group_tokens)
        if self.window_clock is None:
            self.window_clock = step_start
        self.window["tokens"] += group_tokens
        self.window["steps"] += 1
        self.total_tokens += group_tokens
        self.progress.update(1)
        return True

    def _read_tallies(self) -> None:
        """Deferred reads: bring the device tallies and the window's time to the host (one
        sync), log skipped steps and stop after ``max_nonfinite`` in a row."""
        if self.tally is None or self.window_clock is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = self.clock.now() - self.window_clock
        self.window_clock = None
        self.window["time"] += elapsed
        self.total_train_time += elapsed
        reading = self.tally.read()
        self.window["loss"] += reading.loss
        self.window["nll"] += reading.nll
        self.window["tokens"] -= reading.skipped_tokens
        self.total_tokens -= reading.skipped_tokens
        self.nonfinite_in_a_row = reading.run
        if not reading.skipped:
            return
        self.state["nonfinite_skipped"] += reading.skipped
        self.log.line(f"{reading.skipped} non-finite loss(es) since the last read (steps up to "
                      f"{self.step}), updates skipped ({self.state['nonfinite_skipped']} so "
                      f"far, {reading.longest_run} in a row at most)")
        if reading.longest_run >= self.t.max_nonfinite and self.stop_reason is None:
            self.stop_reason = (f"{reading.longest_run} non-finite losses in a row "
                                "(train.max_nonfinite); lower train.lr or check the data")

    def _skip_nonfinite(self) -> None:
        """A non-finite loss: drop the update, count it, stop after too many in a row."""
        self.state["nonfinite_skipped"] += 1
        self.nonfinite_in_a_row += 1
        self.log.line(f"step {self.step + 1}: non-finite loss, update skipped "
                      f"({self.state['nonfinite_skipped']} so far, "
                      f"{self.nonfinite_in_a_row} in a row)")
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler.is_enabled():
            self.scaler.update()
        if self.nonfinite_in_a_row >= self.t.max_nonfinite:
            self.stop_reason = (f"{self.nonfinite_in_a_row} non-finite losses in a row "
                                "(train.max_nonfinite); lower train.lr or check the data")

    def _after_step(self) -> None:
        """Log, check the budgets (every rank decides alike), validate and checkpoint."""
        t = self.t
        if self.seconds_to_first_step is None:
            self.seconds_to_first_step = self.clock.now() - self.created
        if self.step % t.log_every == 0 or self.step % t.validate_every == 0 or (
                t.max_steps and self.step >= t.max_steps):
            self._read_tallies()  # deferred reads only; it may stop the run (non-finite)
        nonfinite_stop = self.stop_reason
        if self.step % t.log_every == 0:
            self._log_window()
        elapsed = self.clock.now() - self.start_time
        # Every rank must take the same decision: combine the time/signal flags.
        out_of_time, signalled = all_reduce_sum(
            [float(bool(self.max_time) and elapsed >= self.max_time),
             float(self.stop_signal.received is not None)], self.ctx, self.device)
        self.stop_reason = self._budget_reached(out_of_time=bool(out_of_time),
                                                epochs=False) or nonfinite_stop
        if self.stop_reason is None and signalled:
            self.stop_reason = f"{self.stop_signal.received or 'signal'} received"
        if self.step % self.t.validate_every == 0 and self.stop_reason is None:
            self.checkpoint(self.run_validation())
            self.last_validated = self.step

    def _out_of_time(self) -> bool:
        return bool(self.max_time) and self.clock.now() - self.start_time >= self.max_time

    def _budget_reached(self, out_of_time: bool, epochs: bool = True) -> str | None:
        t = self.t
        if t.max_steps and self.step >= t.max_steps:
            return f"max_steps={t.max_steps} reached"
        if out_of_time:
            return f"max_time={t.max_time} reached"
        if epochs and t.max_epochs and self.epoch >= t.max_epochs:
            return f"max_epochs={t.max_epochs} reached"
        return None

    def _log_window(self) -> None:
        window = self.window
        if not window["tokens"]:  # deferred reads: every step of the window was skipped
            self.window = {k: 0.0 if k not in INTEGER_KEYS else 0 for k in window}
            return
        tok_s = window["tokens"] / max(window["time"], 1e-9)
        wait_share = self.data_wait / max(window["time"], 1e-9)
        loss_avg = window["loss"] / window["tokens"]
        ppl = math.exp(min(window["nll"] / window["tokens"], 50))
        self.log.line(f"step {self.step} epoch {self.epoch + 1} | loss {loss_avg:.4f} ppl "
                      f"{ppl:.2f} | lr {self.lr:.3e} | {tok_s:,.0f} tgt tok/s | "
                      f"{fill_text(window)} | data wait {100 * wait_share:.1f}%")
        self.log.scalars(self.step, {"train/loss": loss_avg, "train/ppl": ppl,
                                     "train/lr": self.lr, "train/tokens_per_s": tok_s})
        self.progress.set_postfix(loss=f"{loss_avg:.3f}", lr=f"{self.lr:.2e}",
                                  tok_s=f"{tok_s:,.0f}")
        self.window = {k: 0.0 if k not in INTEGER_KEYS else 0 for k in window}
        self.data_wait = 0.0

    # ---- validation and checkpoints
    def run_validation(self) -> dict | None:
        """Validate on rank 0 (the others wait); every rank learns an early stop."""
        ctx, t, state = self.ctx, self.t, self.state
        if not ctx.is_main:
            self.stop_reason = broadcast_object(None, ctx)
            return None
        with self.fp32_weights():
            result = validate(self.model, self.valid_split, self.cfg, self.device,
                              self.policy, self.translator, self.references,
                              note=self.log.line)
        metric = result.get(f"valid_{t.valid_metric}", -result["valid_loss"])
        best = state["best_bleu"]
        if best is None or metric > best:
            state.update({"best_bleu": metric, "best_step": self.step, "bad_validations": 0})
        else:
            state["bad_validations"] += 1
            if t.patience and state["bad_validations"] >= t.patience:
                self.stop_reason = f"early stopping after {t.patience} validations without gain"
        state["validations"] = [*state.get("validations", []), {"step": self.step, **result}]
        self.log.line(f"validate step {self.step}: "
                      + ", ".join(f"{k} {v:.4f}" for k, v in result.items())
                      + f" | best {state['best_bleu']:.4f} at step {state['best_step']}")
        self.log.scalars(self.step, {k.replace("_", "/", 1): v for k, v in result.items()})
        broadcast_object(self.stop_reason, ctx)
        return result

    def checkpoint(self, valid_result: dict | None) -> None:
        """Save step_N (keeping the last K) and, if this step is the best, ``best``."""
        self._read_tallies()  # the trainer state's counts up to this step
        if not self.ctx.is_main:
            return
        state, run_dir = self.state, self.run_dir
        state.update({"step": self.step, "epoch": self.epoch,
                      "batch_in_epoch": self.batch_index,
                      "elapsed": self.clock.now() - self.start_time})
        extra = {"cpu_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            extra["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        target = run_dir / "checkpoints" / f"step_{self.step:08d}"
        with self.fp32_weights():  # the masters, not the bf16 compute copy
            save_checkpoint(target, self.model, self.cfg, self.vocab_files, dict(state),
                            self.optimizer, extra)
            kept = step_checkpoints(run_dir)
            for old in kept[: max(0, len(kept) - max(self.t.keep_last, 1))]:
                shutil.rmtree(old, ignore_errors=True)
            if valid_result is not None and state["best_step"] == self.step:
                save_checkpoint(run_dir / "best", self.model, self.cfg, self.vocab_files,
                                {**state, "valid": valid_result})

    # ---- the end
    def finish(self) -> None:
        """Validate and save the last step (on a signal: save only, quickly)."""
        self._read_tallies()
        self.progress.close()
        if self.last_validated != self.step:
            if self.stop_reason.endswith("received"):
                self.checkpoint(None)
            else:
                self.checkpoint(self.run_validation())
        barrier(self.ctx)

    def summary(self) -> dict:
        """summary.json: steps, stop reason, best step and whether it is the last step."""
        state = self.state
        tok_s = self.total_tokens / max(self.total_train_time, 1e-9)
        summary = {"steps": self.step, "epochs_completed": self.epoch,
                   "stop_reason": self.stop_reason,
                   # the trainer state's best_bleu is the best valid_metric's score, or
                   # -valid_loss when the validation set is not decoded
                   "valid_metric": state["valid_metric"],
                   "best_valid_score": state["best_bleu"] if self.t.validate_bleu else None,
                   "best_valid_bleu": (state["best_bleu"] if self.t.validate_bleu
                                       and self.t.valid_metric == "bleu" else None),
                   "best_valid_loss": (-state["best_bleu"] if not self.t.validate_bleu
                                       and state["best_bleu"] is not None else None),
                   "best_step": state["best_step"],
                   "still_improving": state["best_step"] == self.step,
                   "validations": state.get("validations", []),
                   "train_tokens_per_s": tok_s, "parameters": self.params["total"],
                   "wall_time_s": self.clock.now() - self.start_time,
                   "seconds_to_first_step": self.seconds_to_first_step,
                   "nonfinite_skipped": state["nonfinite_skipped"],
                   "precision": self.precision,
                   # what this process did: resumed from which step, how many steps it ran
                   "resumed_from_step": self.first_step if self.resume_from else None,
                   "steps_this_run": self.step - self.first_step}
        if self.device.type == "cuda":  # what the caching allocator went through
            stats = torch.cuda.memory_stats(self.device)
            self.log.line(f"cuda memory: peak {stats['allocated_bytes.all.peak'] / 2**30:.1f} "
                          f"GiB allocated, {stats['segment.all.allocated']} cudaMalloc "
                          f"segments, {stats['num_alloc_retries']} allocator retries "
                          f"(each frees the cache and synchronizes)")
        self.log.line(f"done: {self.stop_reason}; {self.step} steps, {tok_s:,.0f} target "
                      f"tokens/s, best valid {VALID_METRIC_NAMES[state['valid_metric']]} "
                      f"{state['best_bleu']} at step {state['best_step']}")
        if self.ctx.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            resolve_checkpoint(self.run_dir)  # sanity: the run is loadable
        self.log.close()
        shutdown(self.ctx)
        return summary


def train(cfg: Config, data_dir: str | Path, run_dir: str | Path) -> dict:
    """Train (or resume) a model; return a summary dict (steps, best BLEU, tokens/s...)."""
    return TrainingRun(cfg, data_dir, run_dir).run()
