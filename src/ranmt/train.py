"""The training loop, explicit from top to bottom (nanoGPT style).

``train(cfg, data_dir, run_dir)``: token-bucketed batches, Adam (0.9, 0.98) with linear
warm-up and inverse-square-root decay, label-smoothed cross-entropy, gradient
accumulation and clipping, autocast (bf16/fp16) on CUDA, validation loss and greedy BLEU
every ``validate_every`` steps, best-by-BLEU and last-K checkpoints, early stopping,
``max_steps`` / ``max_epochs`` / ``max_time`` limits, exact resume (model, optimizer,
schedule, RNG, epoch and batch position), TensorBoard scalars and a progress bar.

Loss: ``F.cross_entropy(..., label_smoothing=eps)``, i.e. for a target y and V classes
``(1 - eps) * (-log p_y) + eps * mean_v(-log p_v)``, summed over non-pad target tokens.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ranmt.checkpoint import (
    load_checkpoint,
    load_training_state,
    resolve_checkpoint,
    save_checkpoint,
    step_checkpoints,
)
from ranmt.config import Config, from_dict, parse_duration, save_yaml, to_dict
from ranmt.data.batching import BatchPrefetcher, batch_from_split, make_batches
from ranmt.data.corpus import load_meta, load_split, raw_text
from ranmt.data.vocab import PAD, Vocab
from ranmt.distributed import (
    all_reduce_sum,
    barrier,
    broadcast_object,
    init_distributed,
    shutdown,
)
from ranmt.evaluate import score
from ranmt.model import build_model, count_parameters
from ranmt.translator import Translator


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


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, smoothing: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed smoothed loss, summed NLL) over non-pad tokens; logits (B, T, V), target (B, T)."""
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_target = target.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_target, ignore_index=PAD,
                           label_smoothing=smoothing, reduction="sum")
    with torch.no_grad():
        nll = F.cross_entropy(flat_logits, flat_target, ignore_index=PAD, reduction="sum")
    return loss, nll


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "fp32":
        return None
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    return torch.bfloat16 if precision == "bf16" else torch.float16


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
def validate(model, valid, cfg: Config, device, autocast_dtype, translator: Translator | None,
             references: list[str]) -> dict:
    """Validation loss/perplexity and (optionally) greedy BLEU."""
    model.eval()
    total_loss = total_nll = total_tokens = 0.0
    lengths = np.array([len(s) for s in valid.src]), np.array([len(t) for t in valid.tgt])
    for indices in make_batches(*lengths, cfg.data.max_tokens):
        batch = batch_from_split(valid, indices, cfg.model.max_positions).to(device)
        with torch.autocast(device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            logits = model(batch.src, batch.tgt_in)
        loss, nll = label_smoothed_loss(logits, batch.tgt_out, cfg.train.label_smoothing)
        total_loss += float(loss)
        total_nll += float(nll)
        total_tokens += batch.target_tokens
    limit = cfg.model.max_positions - 1
    truncated = sum(1 for s, t in zip(valid.src, valid.tgt) if len(s) > limit or len(t) > limit)
    if truncated:
        tqdm.write(f"note: {truncated} validation pair(s) longer than {limit} subwords were "
                   "truncated for the validation loss", file=sys.stderr)
    result = {"valid_loss": total_loss / total_tokens,
              "valid_nll": total_nll / total_tokens,
              "valid_ppl": math.exp(min(total_nll / total_tokens, 50))}
    if translator is not None:
        limit = cfg.train.valid_max_sentences or len(valid)
        ids = [list(map(int, s)) for s in valid.src[:limit]]
        hyps = translator.translate_ids(ids)
        text = translator.tgt_vocab.decode([h[0][0] for h in hyps])
        result["valid_bleu"] = score(text, references[:limit], metrics=("bleu",))["bleu"]
    model.train()
    return result


def _latest_training_checkpoint(run_dir: Path) -> Path | None:
    steps = step_checkpoints(run_dir)
    return steps[-1] if steps else None


def train(cfg: Config, data_dir: str | Path, run_dir: str | Path) -> dict:
    """Train (or resume) a model; return a summary dict (steps, best BLEU, tokens/s...)."""
    data_dir, run_dir = Path(data_dir), Path(run_dir)
    meta = load_meta(data_dir)
    cfg.data.dir = str(data_dir)
    cfg.model.src_vocab_size = meta["src_vocab_size"]
    cfg.model.tgt_vocab_size = meta["tgt_vocab_size"]
    cfg.model.joint_vocab = bool(meta["joint_vocab"])
    if cfg.model.hardcoded.gamma <= 0:
        cfg.model.hardcoded.gamma = float(meta.get("gamma", 1.0))
    vocab_files = {"src": data_dir / "spm.src.model", "tgt": data_dir / "spm.tgt.model"}

    ctx, device = init_distributed(cfg.train.device)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast_dtype = _autocast_dtype(cfg.train.precision, device)
    torch.manual_seed(cfg.train.seed)

    resume_from = _latest_training_checkpoint(run_dir)
    trainer_state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "elapsed": 0.0,
                     "best_bleu": None, "best_step": None, "bad_validations": 0,
                     "nonfinite_skipped": 0}
    if resume_from is not None:
        model, saved_cfg, saved_meta, _ = load_checkpoint(resume_from, device)
        if to_dict(saved_cfg.model) != to_dict(cfg.model):
            print(f"note: resuming {run_dir} with the model config stored in its checkpoint",
                  file=sys.stderr)
            cfg.model = from_dict({"model": to_dict(saved_cfg.model)}).model
        trainer_state.update(saved_meta["trainer"])
    else:
        model = build_model(cfg.model).to(device)
    model.train()
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, run_dir / "config.yaml")
    # The model used for training steps: DDP-wrapped across ranks, optionally compiled.
    # Checkpoints, validation and decoding always use the plain `model`.
    step_model = ddp_model = model
    if ctx.enabled:
        step_model = ddp_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.train.compile:
        step_model = torch.compile(step_model)

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr,
                                 betas=tuple(cfg.train.adam_betas), eps=cfg.train.adam_eps,
                                 weight_decay=cfg.train.weight_decay)
    if resume_from is not None:
        optim_state, extra = load_training_state(resume_from)
        optimizer.load_state_dict(optim_state)
        torch.set_rng_state(extra["cpu_rng"])
        if device.type == "cuda" and "cuda_rng" in extra:
            torch.cuda.set_rng_state(extra["cuda_rng"], device)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)

    train_split = load_split(data_dir, "train")
    valid_split = load_split(data_dir, "valid")
    references = raw_text(data_dir, "valid", "tgt")
    src_lens, tgt_lens = train_split.lengths()
    too_long = (src_lens >= cfg.model.max_positions) | (tgt_lens >= cfg.model.max_positions)
    if too_long.any():
        # Data prepared with a larger --max-positions than the model's N: skip, and say so.
        keep = np.flatnonzero(~too_long)
        print(f"note: {int(too_long.sum())} training pair(s) longer than model.max_positions-1 "
              f"= {cfg.model.max_positions - 1} subwords are skipped", file=sys.stderr)
        train_split = type(train_split)([train_split.src[i] for i in keep],
                                        [train_split.tgt[i] for i in keep])
        src_lens, tgt_lens = src_lens[keep], tgt_lens[keep]
    translator = None
    if cfg.train.validate_bleu:
        translator = Translator(model, cfg, Vocab(vocab_files["src"]), Vocab(vocab_files["tgt"]),
                                device)
        translator.decode_config = type(cfg.decode)(**{**to_dict(cfg.decode), "beam": 1,
                                                       "nbest": 1, "truncate_long": True})

    log = Logger(run_dir, cfg.train.tensorboard) if ctx.is_main else NullLogger()
    params = count_parameters(model)
    log.line(f"ranmt train: {params['total']:,} parameters, device {device}, "
             f"precision {autocast_dtype or 'fp32'}, {len(train_split)} training pairs"
             + (f", {ctx.world_size} processes (effective batch: data.max_tokens x "
                f"{ctx.world_size} x train.accumulation)" if ctx.enabled else "")
             + (f", resuming from {resume_from.name}" if resume_from else ""))
    if ctx.is_main:
        (run_dir / "parameters.json").write_text(json.dumps(params, indent=1))

    max_time = parse_duration(cfg.train.max_time)
    t = cfg.train
    step, epoch = trainer_state["step"], trainer_state["epoch"]
    start_batch = trainer_state["batch_in_epoch"]
    start_time = time.monotonic() - trainer_state["elapsed"]
    window = {"loss": 0.0, "nll": 0.0, "tokens": 0, "time": 0.0, "steps": 0}
    total_tokens, total_train_time = 0, 0.0
    last_validated = step if resume_from is not None else -1
    stop_reason = None
    progress = tqdm(total=t.max_steps or None, initial=step,
                    disable=not t.progress or not ctx.is_main,
                    unit="step", dynamic_ncols=True, mininterval=2.0, file=sys.stderr)

    def checkpoint(valid_result: dict | None) -> None:
        nonlocal trainer_state
        if not ctx.is_main:
            return
        trainer_state.update({"step": step, "epoch": epoch, "batch_in_epoch": batch_index,
                              "elapsed": time.monotonic() - start_time})
        extra = {"cpu_rng": torch.get_rng_state()}
        if device.type == "cuda":
            extra["cuda_rng"] = torch.cuda.get_rng_state(device)
        target = run_dir / "checkpoints" / f"step_{step:08d}"
        save_checkpoint(target, model, cfg, vocab_files, dict(trainer_state), optimizer, extra)
        kept = step_checkpoints(run_dir)
        for old in kept[: max(0, len(kept) - max(t.keep_last, 1))]:
            shutil.rmtree(old, ignore_errors=True)
        if valid_result is not None and trainer_state["best_step"] == step:
            save_checkpoint(run_dir / "best", model, cfg, vocab_files,
                            {**trainer_state, "valid": valid_result})

    def run_validation() -> dict | None:
        """Validate on rank 0 (the others wait); every rank learns an early stop."""
        nonlocal stop_reason
        if not ctx.is_main:
            stop_reason = broadcast_object(None, ctx)
            return None
        result = validate(model, valid_split, cfg, device, autocast_dtype, translator,
                          references)
        metric = result.get("valid_bleu", -result["valid_loss"])
        best = trainer_state["best_bleu"]
        if best is None or metric > best:
            trainer_state.update({"best_bleu": metric, "best_step": step,
                                  "bad_validations": 0})
        else:
            trainer_state["bad_validations"] += 1
            if t.patience and trainer_state["bad_validations"] >= t.patience:
                stop_reason = f"early stopping after {t.patience} validations without gain"
        log.line(f"validate step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in
                                                       result.items())
                 + f" | best {trainer_state['best_bleu']:.4f} at step "
                 f"{trainer_state['best_step']}")
        log.scalars(step, {k.replace("_", "/", 1): v for k, v in result.items()})
        broadcast_object(stop_reason, ctx)
        return result

    batch_index = start_batch
    nonfinite_in_a_row = 0
    data_wait = 0.0  # seconds spent building batches in the current log window
    if resume_from is not None:  # a finished run resumed with the same budget stops at once
        if t.max_steps and step >= t.max_steps:
            stop_reason = f"max_steps={t.max_steps} reached"
        elif max_time and time.monotonic() - start_time >= max_time:
            stop_reason = f"max_time={t.max_time} reached"
        elif t.max_epochs and epoch >= t.max_epochs:
            stop_reason = f"max_epochs={t.max_epochs} reached"
    with _StopSignal() as stop_signal:
        while stop_reason is None:
            if t.max_epochs and epoch >= t.max_epochs:
                stop_reason = f"max_epochs={t.max_epochs} reached"
                break
            batches = make_batches(src_lens, tgt_lens, cfg.data.max_tokens,
                                   cfg.data.max_sentences, seed=t.seed, epoch=epoch,
                                   noise=cfg.data.bucket_noise)
            # One optimizer step consumes world_size x accumulation consecutive batches;
            # rank r takes every world_size-th of them (a disjoint shard of the epoch).
            per_step = ctx.world_size * t.accumulation
            plan, position = [], batch_index
            while len(batches) - position >= ctx.world_size:
                plan.extend(batches[position: position + per_step][ctx.rank::ctx.world_size])
                position += min(per_step, len(batches) - position)
            prefetcher = BatchPrefetcher(train_split, plan)  # a worker builds the batches
            try:
                while len(batches) - batch_index >= ctx.world_size:
                    group = batches[batch_index: batch_index + per_step][ctx.rank::ctx.world_size]
                    step_start = time.monotonic()
                    optimizer.zero_grad(set_to_none=True)
                    local_tokens = sum(int((tgt_lens[b] + 1).sum()) for b in group)
                    group_tokens = int(all_reduce_sum([local_tokens], ctx, device)[0])
                    # DDP averages gradients over ranks: scale so the result is the sum of all
                    # ranks' losses over all their target tokens (equal to one big batch).
                    loss_scale = ctx.world_size / group_tokens
                    local_loss = local_nll = 0.0
                    for position, indices in enumerate(group):
                        wait_start = time.monotonic()
                        batch = next(prefetcher)
                        assert batch.indices is indices, "batch plan out of step"
                        batch = batch.to(device)
                        data_wait += time.monotonic() - wait_start
                        last = position == len(group) - 1
                        # accumulate locally; all-reduce only with the group's last backward
                        sync = contextlib.nullcontext() if (last or not ctx.enabled) \
                            else ddp_model.no_sync()
                        with sync:
                            with torch.autocast(device.type, dtype=autocast_dtype,
                                                enabled=autocast_dtype is not None):
                                logits = step_model(batch.src, batch.tgt_in)
                            loss, nll = label_smoothed_loss(logits, batch.tgt_out,
                                                            t.label_smoothing)
                            scaler.scale(loss * loss_scale).backward()
                        local_loss += float(loss.detach())
                        local_nll += float(nll)
                    group_loss, group_nll = all_reduce_sum([local_loss, local_nll], ctx, device)
                    batch_index += min(per_step, len(batches) - batch_index)
                    if not math.isfinite(group_loss):
                        trainer_state["nonfinite_skipped"] += 1
                        nonfinite_in_a_row += 1
                        log.line(f"step {step + 1}: non-finite loss, update skipped "
                                 f"({trainer_state['nonfinite_skipped']} so far, "
                                 f"{nonfinite_in_a_row} in a row)")
                        optimizer.zero_grad(set_to_none=True)
                        if scaler.is_enabled():
                            scaler.update()
                        if nonfinite_in_a_row >= t.max_nonfinite:
                            stop_reason = (f"{nonfinite_in_a_row} non-finite losses in a "
                                           "row (train.max_nonfinite); lower train.lr or "
                                           "check the data")
                            break
                        continue
                    nonfinite_in_a_row = 0
                    lr = inverse_sqrt_lr(step + 1, t.lr, t.warmup_steps, t.warmup_init_lr)
                    for group_params in optimizer.param_groups:
                        group_params["lr"] = lr
                    scaler.unscale_(optimizer)
                    if t.clip_norm > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm)
                    scaler.step(optimizer)
                    scaler.update()
                    step += 1
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    elapsed_step = time.monotonic() - step_start
                    window["loss"] += group_loss
                    window["nll"] += group_nll
                    window["tokens"] += group_tokens
                    window["time"] += elapsed_step
                    window["steps"] += 1
                    total_tokens += group_tokens
                    total_train_time += elapsed_step
                    progress.update(1)
                    if step % t.log_every == 0:
                        tok_s = window["tokens"] / max(window["time"], 1e-9)
                        wait_share = data_wait / max(window["time"], 1e-9)
                        loss_avg = window["loss"] / window["tokens"]
                        ppl = math.exp(min(window["nll"] / window["tokens"], 50))
                        log.line(f"step {step} epoch {epoch + 1} | loss {loss_avg:.4f} ppl "
                                 f"{ppl:.2f} | lr {lr:.3e} | {tok_s:,.0f} tgt tok/s | data wait "
                                 f"{100 * wait_share:.1f}%")
                        log.scalars(step, {"train/loss": loss_avg, "train/ppl": ppl, "train/lr": lr,
                                           "train/tokens_per_s": tok_s})
                        progress.set_postfix(loss=f"{loss_avg:.3f}", lr=f"{lr:.2e}",
                                             tok_s=f"{tok_s:,.0f}")
                        window = {k: 0.0 if k != "tokens" else 0 for k in window}
                        data_wait = 0.0
                    elapsed = time.monotonic() - start_time
                    # Every rank must take the same decision: combine the time/signal flags.
                    out_of_time, signalled = all_reduce_sum(
                        [float(bool(max_time) and elapsed >= max_time),
                         float(stop_signal.received is not None)], ctx, device)
                    if t.max_steps and step >= t.max_steps:
                        stop_reason = f"max_steps={t.max_steps} reached"
                    elif out_of_time:
                        stop_reason = f"max_time={t.max_time} reached"
                    elif signalled:
                        stop_reason = f"{stop_signal.received or 'signal'} received"
                    if step % t.validate_every == 0 and stop_reason is None:
                        checkpoint(run_validation())
                        last_validated = step
                    if stop_reason is not None:
                        break
            finally:
                prefetcher.close()
            if stop_reason is None:
                epoch += 1
                batch_index = 0
        progress.close()
        if last_validated != step:
            if stop_reason.endswith("received"):
                checkpoint(None)  # be quick on a signal: save, skip validation
            else:
                checkpoint(run_validation())
        barrier(ctx)
    tok_s = total_tokens / max(total_train_time, 1e-9)
    summary = {"steps": step, "epochs_completed": epoch, "stop_reason": stop_reason,
               "best_valid_bleu": trainer_state["best_bleu"],
               "best_step": trainer_state["best_step"],
               "train_tokens_per_s": tok_s, "parameters": params["total"],
               "wall_time_s": time.monotonic() - start_time,
               "nonfinite_skipped": trainer_state["nonfinite_skipped"]}
    log.line(f"done: {stop_reason}; {step} steps, {tok_s:,.0f} target tokens/s, best valid "
             f"{'BLEU' if cfg.train.validate_bleu else '-loss'} {trainer_state['best_bleu']} "
             f"at step {trainer_state['best_step']}")
    if ctx.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        resolve_checkpoint(run_dir)  # sanity: the run is loadable
    log.close()
    shutdown(ctx)
    return summary
