"""Training steps whose results the host reads only now and then (``train.host_reads``).

On a GPU every host read of a device value (``float(loss)``, ``math.isfinite`` of it, a
``torch.cuda.synchronize`` to time the step) makes the host wait until the device has run
everything queued so far; a launch-bound step then costs the host's issuing time *plus*
the device's running time, where it could cost the larger of the two (the host queues the
next step while the device runs this one). The trainer's per-step reads made its step
about 1.6x the bare step on an H100 (docs/PERFORMANCE.md "On a GPU").

With ``train.host_reads=log`` (the default on CUDA) a step keeps its results on the device:

* the step's summed loss and NLL are added to device tallies (:class:`DeviceTally`),
  read on the host (one read) every ``log_every`` steps and before a validation, a
  checkpoint or the end of the run (:meth:`DeviceTally.read`);
* a non-finite loss still skips its update, decided on the device: fused Adam takes a
  ``found_inf`` flag (the protocol PyTorch's GradScaler uses) and leaves parameters,
  moments and step count untouched when it is set. Unlike ``step`` mode the skipped step
  counts as a step, and "too many non-finite losses in a row" (``train.max_nonfinite``) is
  noticed at the next read;
* the step time is measured over the window between reads (one synchronize there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TallyReading:
    """What the device tallies held since the last read."""

    loss: float
    """Summed training loss of the steps whose update was applied."""
    nll: float
    """Summed NLL of those steps."""
    skipped: int
    """Steps skipped for a non-finite loss."""
    skipped_tokens: int
    """Target tokens of the skipped steps."""
    longest_run: int
    """The longest run of consecutive skipped steps that reached into this window."""
    run: int
    """Consecutive skipped steps at the read (continues into the next window)."""


class DeviceTally:
    """Running sums of training steps kept on ``device`` (float64 where the device has it:
    a window of summed losses reaches 1e7)."""

    def __init__(self, device: torch.device):
        self.dtype = torch.float32 if device.type == "mps" else torch.float64
        # loss, nll, skipped, skipped tokens, longest run, current run
        self.sums = torch.zeros(6, dtype=self.dtype, device=device)

    def nonfinite(self, step_sums: Tensor) -> Tensor:
        """0-dim float32 flag (1.0: skip this update) for a step's (loss, nll) sums (2,)."""
        return (~torch.isfinite(step_sums[0])).to(torch.float32)

    def add(self, step_sums: Tensor, skip: Tensor, tokens: int) -> None:
        """Add one step: its (loss, nll) sums (2,), its skip flag (0-dim), its tokens."""
        sums = self.sums
        kept = torch.where(skip.bool(), 0.0, step_sums.to(self.dtype))  # (2,)
        sums[:2] += kept
        flag = skip.to(self.dtype)
        sums[2] += flag
        sums[3] += flag * tokens
        sums[5] = (sums[5] + 1) * flag  # the current run of skipped steps
        sums[4] = torch.maximum(sums[4], sums[5])

    def read(self) -> TallyReading:
        """Read (one host sync) and reset the window's sums; the current run carries on."""
        loss, nll, skipped, skipped_tokens, longest, run = self.sums.tolist()
        self.sums[:5] = 0
        self.sums[4] = self.sums[5]
        return TallyReading(loss, nll, round(skipped), round(skipped_tokens), round(longest),
                            round(run))
