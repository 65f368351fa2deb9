"""Precision per device: the policy object every training step, validation and benchmark
runs under, whether a CPU computes bf16 natively, and bf16 activations.

**The policy.** :class:`PrecisionPolicy` (a resolved precision on one device type) decides
what a precision means there, in one place: on a CPU with native bf16, ``bf16`` is autocast
*and* bf16 residual streams (below) with fp32 attention softmaxes under dropout; on CUDA it
is plain bf16 autocast (SDPA runs its fused bf16 kernels; no CPU-only tricks), fp32 uses TF32
matrix products, and the optimizer is PyTorch's fused Adam. ``policy.forward()`` is the
context of every forward pass, so training, validation and the benchmarks run one numeric
regime. ``auto`` (:func:`resolve_precision`): bf16 on a CPU with native bf16, bf16 autocast
on a CUDA GPU with bf16 (``base`` TransF 1.14-1.24x fp32/TF32 at equal valid loss on an H200
once the trainer stopped being host-bound; docs/PERFORMANCE.md "On a GPU"), fp32 (TF32
products) on other GPUs, fp32 elsewhere; the reason goes into the log line.

**Native bf16.** ``train.precision=auto`` picks bf16 on a CPU only where the CPU has bf16
instructions (AVX512-BF16 or AMX-BF16, read from the CPU flags the kernel reports) — there
oneDNN's bf16 matrix products run at 2-3x fp32; elsewhere bf16 is emulated and slower, and
``auto`` stays fp32 (:func:`cpu_bf16_support` says why, for the log line).

**bf16 activations.** ``torch.autocast("cpu", torch.bfloat16)`` runs the matrix products in
bf16 but leaves the tensors between them as they come: the residual stream, layer norms,
dropout, activations and softmaxes stay fp32 when the embeddings are fp32, and every
product casts its fp32 input again. Under :func:`bf16_activations` the embedders cast their
output to bf16, so the whole residual stream is bf16 (half the memory traffic of the
elementwise work, no casts between products), while the weights stay fp32 (master copies,
cast once per autocast region by autocast's cache), gradients reach them in fp32, and the
optimizer state is fp32. Softmax-like reductions accumulate in fp32 inside PyTorch's bf16
kernels; the loss is computed from fp32 logits (``ranmt.training.train.label_smoothed_loss``).
"""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path

import torch

_activation_dtype: torch.dtype | None = None
"""Set by :func:`bf16_activations` (a plain module variable: torch.compile traces its reads
without a graph break, which a ContextVar would cause)."""

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


MATRIX_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni", "amx_int8")
"""CPU flags that decide how fast bf16 and int8 matrix products run (named in benchmarks)."""


def _read_cpuinfo() -> str | None:
    path = Path("/proc/cpuinfo")
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None


def _cpuinfo_field(cpuinfo: str, names: tuple[str, ...]) -> str | None:
    """The value of the first line of ``cpuinfo`` whose key is one of ``names``."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return None


def _cpu_flags(cpuinfo: str) -> set[str]:
    """The CPU flags (x86 ``flags``, Arm ``Features``) of the first processor in ``cpuinfo``."""
    return set((_cpuinfo_field(cpuinfo, ("flags", "Features")) or "").split())


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU in a few words for benchmark records: its model name and which of
    :data:`MATRIX_FLAGS` it has, e.g. ``"Intel(R) Xeon(R) Processor; amx_bf16 avx512_bf16
    ..."`` — speed ratios between precisions (and against CTranslate2's int8) depend on them.
    ``cpuinfo``: the text of /proc/cpuinfo (read on Linux when not given)."""
    cpuinfo = _read_cpuinfo() if cpuinfo is None else cpuinfo
    if cpuinfo is None:
        return platform.processor() or platform.machine() or "unknown CPU"
    name = _cpuinfo_field(cpuinfo, ("model name", "Model", "Hardware")) or "unknown CPU"
    found = [flag for flag in MATRIX_FLAGS if flag in _cpu_flags(cpuinfo)]
    return f"{name}; {' '.join(found) if found else 'no bf16/VNNI/AMX flags'}"


def cpu_bf16_support(cpuinfo: str | None = None) -> tuple[bool, str]:
    """(native bf16 on this CPU, the reason in words). ``cpuinfo``: the text of
    /proc/cpuinfo (read on Linux when not given; other systems: not detected)."""
    cpuinfo = _read_cpuinfo() if cpuinfo is None else cpuinfo
    if cpuinfo is None:
        return False, f"cannot read CPU flags on {platform.system()}: assuming no native bf16"
    found = [flag for flag in BF16_FLAGS if flag in _cpu_flags(cpuinfo)]
    if found:
        return True, f"the CPU has {' and '.join(found)}"
    return False, "the CPU has neither AVX512-BF16 nor AMX-BF16 (bf16 would be emulated)"


def activation_dtype() -> torch.dtype | None:
    """The dtype embedders cast their output to (None: leave it as computed)."""
    return _activation_dtype


@contextlib.contextmanager
def bf16_activations(enabled: bool = True):
    """Within: embedder outputs (and so the residual streams) are bf16 (the training loop's
    thread; not meant to be entered from several threads at once)."""
    global _activation_dtype
    previous = _activation_dtype
    _activation_dtype = torch.bfloat16 if enabled else None
    try:
        yield
    finally:
        _activation_dtype = previous


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "bf16-weights": None, "fp16": torch.float16}
"""Resolved precision name -> the autocast dtype (None: no autocast). ``bf16-weights`` needs
none: its parameters are bf16 (a compute copy of fp32 master weights)."""


class PrecisionError(ValueError):
    pass


CUDA_AUTO_REASON = ("auto: bf16 autocast on a CUDA GPU with bf16 (base TransF trained 1.14-1.24x"
                    " faster than fp32/TF32 at equal valid loss on an H200, RAN-ALL 0.93-0.99x;"
                    " docs/PERFORMANCE.md 'On a GPU')")
CUDA_NO_BF16_REASON = "auto: this GPU has no bf16; fp32 with TF32 products where it has them"


def resolve_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """``train.precision`` (auto | fp32 | bf16 | fp16) on ``device`` -> (fp32 | bf16 | fp16,
    the reason in words). ``auto``: bf16 on a CPU with native bf16
    (:func:`cpu_bf16_support`), bf16 on a CUDA GPU with bf16, where it measured faster
    (:data:`CUDA_AUTO_REASON`), fp32 (TF32 products) on other GPUs, fp32 elsewhere. An
    explicit ``bf16`` on a CPU without native bf16 is an error (it would run, emulated,
    slower than fp32); on a GPU without bf16 too."""
    if requested in ("fp32", "fp16"):
        return requested, "as configured"
    if requested not in ("auto", "bf16", "bf16-weights"):
        raise PrecisionError(f"train.precision must be auto, fp32, bf16, bf16-weights or "
                             f"fp16, not '{requested}'")
    if device.type == "cuda":
        if requested == "auto":
            if torch.cuda.is_bf16_supported():
                return "bf16", CUDA_AUTO_REASON
            return "fp32", CUDA_NO_BF16_REASON
        if not torch.cuda.is_bf16_supported():
            raise PrecisionError(f"train.precision={requested} on a GPU without bf16; use "
                                 "fp32 or fp16")
        return requested, "as configured"
    native, why = cpu_bf16_support()
    if requested != "auto":
        if not native:
            raise PrecisionError(f"train.precision={requested} on this CPU: {why}; use fp32 "
                                 "(or auto, which picks fp32 here)")
        return requested, why
    return ("bf16" if native else "fp32"), f"auto: {why}"


def legacy_precision(requested: str, device: torch.device) -> str:
    """What ``auto`` meant before CPUs got bf16 (runs and grid cells started then):
    bf16 only on a CUDA GPU with bf16, fp32 on every CPU."""
    if requested != "auto":
        return requested
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def avoid_cudnn_attention() -> None:
    """Leave CUDA's scaled dot-product attention to the flash and memory-efficient kernels
    (process-wide). cuDNN's attention, which PyTorch picks for bf16 with a mask on Hopper,
    builds an execution plan on the first call of every new shape (143 ms against 1.3 ms
    for memory-efficient attention on an H200, `benchmarks/sdpa_shapes.py`); training
    batches change shape nearly every step and incremental decoding every step."""
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


class PrecisionPolicy:
    """A resolved precision (fp32 | bf16 | fp16) on one device type (cpu | cuda | ...): what
    it means there, for every forward pass, the optimizer and the matrix products.

    ``forward()`` is the context of a forward pass (training step, validation, benchmark):
    autocast to :attr:`autocast_dtype` and, for bf16 on a CPU, bf16 residual streams.
    """

    def __init__(self, name: str, device_type: str, reason: str = "as configured"):
        if name not in PRECISIONS:
            raise PrecisionError(f"a resolved precision is fp32, bf16 or fp16, not '{name}'")
        self.name, self.device_type, self.reason = name, device_type, reason

    @classmethod
    def resolve(cls, requested: str, device: torch.device) -> PrecisionPolicy:
        """The policy of ``train.precision`` ``requested`` on ``device``
        (:func:`resolve_precision`)."""
        name, reason = resolve_precision(requested, device)
        return cls(name, device.type, reason)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype (None: no autocast)."""
        return PRECISIONS[self.name]

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """The dtype of the parameters' compute copy, with fp32 master weights in the
        optimizer (``bf16-weights``; :mod:`ranmt.training.master`), else None (fp32)."""
        return torch.bfloat16 if self.name == "bf16-weights" else None

    @property
    def bf16_residual_stream(self) -> bool:
        """Embedders cast to bf16 (:func:`bf16_activations`): bf16 on a CPU only. On CUDA
        autocast alone is faster (the elementwise work is not what limits a GPU)."""
        return self.name == "bf16" and self.device_type == "cpu"

    @property
    def fused_optimizer(self) -> bool:
        """Adam's update as one fused kernel (``fused=True``): on CUDA, where it saves a
        launch per parameter; the CPU keeps the ``foreach`` update its results were made with."""
        return self.device_type == "cuda"

    @property
    def tf32(self) -> bool:
        """fp32 matrix products in TF32 (CUDA)."""
        return self.device_type == "cuda"

    def configure_matmuls(self) -> None:
        """Set the process-wide matrix-product options this policy wants: TF32 on CUDA, and
        on CUDA no cuDNN kernel for scaled dot-product attention (flash and memory-efficient
        attention remain). cuDNN's attention builds an execution plan for every new shape,
        and training batches change shape every step: on an H200 (PyTorch 2.11, CUDA 13)
        a bf16 `base` TransF trained at 29k target tokens/s over its first 50 steps with it
        against fp32's 137k (docs/PERFORMANCE.md "On a GPU", `benchmarks/sdpa_shapes.py`)."""
        if self.tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if self.device_type == "cuda":
            avoid_cudnn_attention()

    @property
    def loss_scaling(self) -> bool:
        """fp16 needs a gradient scaler; bf16 and fp32 do not."""
        return self.name == "fp16"

    def describe(self) -> str:
        """For the log line: e.g. ``bf16 (the CPU has avx512_bf16)``."""
        return f"{self.name} ({self.reason})"

    @contextlib.contextmanager
    def forward(self):
        """The context of a forward pass in this precision."""
        with torch.autocast(self.device_type, dtype=self.autocast_dtype,
                            enabled=self.autocast_dtype is not None), \
                bf16_activations(self.bf16_residual_stream):
            yield

    def __repr__(self) -> str:
        return f"PrecisionPolicy({self.name!r}, {self.device_type!r}, {self.reason!r})"
