"""CPU memory for training and decoding: keep freed heap memory for reuse instead of
returning it at once, and keep oneDNN's cache of compiled bf16 products small.

A training step allocates and frees the same large tensors every step (activations, the
(tokens x vocabulary) logits and their gradient: ~120 MB each for a 160 x 24 batch and an
8k vocabulary). glibc's malloc serves blocks above ``M_MMAP_THRESHOLD`` (128 KB to 32 MB,
adaptive) with ``mmap`` and unmaps them on free, so every step touches fresh pages and pays
a page fault per 4 KB — measured by ``benchmarks/profile_train.py``, a new 123 MB buffer
costs ~50 ms before any arithmetic, ~15% of a bf16 step. :func:`retain_freed_memory` raises
the mmap threshold and the trim threshold (``mallopt``), so large blocks come from the heap
and stay there for the next step: the process keeps its high-water mark of memory (as the
caching allocators of GPUs do), and a step stops faulting. The same effect without code:
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment, or jemalloc /
tcmalloc through ``LD_PRELOAD``.

Decoding has the same pattern: every step of a beam search allocates its (rows x vocabulary)
logits, their fp32 copy and the log-probabilities (12.8 MB each at batch 100, beam 4, an 8k
vocabulary), and profiling bf16 decoding put ~45% of the time in the cast and the
log-softmax, nearly all of it page faults. ``Translator.load`` on a CPU therefore applies
:func:`retain_freed_memory` too (measured: bf16 decoding 1.13x, int8 1.29x, fp32 1.09x faster
at fixed length 30, batch 100, beam 4; docs/PERFORMANCE.md).

bf16 training holds a second, larger store: oneDNN, which runs CPU autocast's bf16 matrix
products, caches one compiled primitive per product *shape* (1,024 by default, ~2 MB each),
and bucketed batches of varying length make a few hundred new shapes every 40 steps. The
students grid's process grew to 8 GiB that way. :func:`cap_onednn_primitive_cache` keeps 16
(measured: 0.59x the peak resident memory of 300 student steps, same losses, same speed;
docs/PERFORMANCE.md "bf16 on a CPU"); ``ranmt train`` and ``ranmt experiment`` call it first
thing and the trainer calls it for a CPU run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_applied = False

ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
"""The environment variables oneDNN reads its primitive-cache capacity from (new name, old)."""

TRAINING_PRIMITIVE_CACHE = 16
"""The capacity ranmt sets for training: 40 steps of the ``student`` preset create 737
distinct primitives with any capacity, re-create 439 more with 16 and 411 more with 64 (~10 ms
a step more with 16, ~1% of a ~0.8 s step), so a larger cache buys little but memory."""


def retain_freed_memory() -> bool:
    """Tune glibc's malloc as above (once per process); False where there is no glibc."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: nothing to tune this way
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = (mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
            and mallopt(_M_TOP_PAD, 1 << 26) == 1)
    _applied = done
    return done


def freeze_startup_heap() -> None:
    """Collect garbage once, then move every object alive (the models, their vocabularies,
    the libraries) to the collector's permanent generation. A served process allocates
    quickly under a burst, and each full collection then traversed all of them: one took
    ~95 ms of the event loop in the middle of a 60-request burst (AMD EPYC Zen 4, RAN-D
    ``small``), half the time the burst's refusals waited (SERVING.md, "Run 5"). Objects
    made later are collected as before. ``ranmt serve`` calls it in the server and in each
    decoding worker once their models are warm."""
    import gc

    gc.collect()
    gc.freeze()


def cap_onednn_primitive_cache(capacity: int = TRAINING_PRIMITIVE_CACHE) -> bool:
    """Set oneDNN's primitive-cache capacity to ``capacity`` unless the environment names one
    (the user's value wins; set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024`` for oneDNN's own
    default). oneDNN reads the variable once, when the process creates its first primitive:
    checked with oneDNN's verbose log, a value set after ``import torch`` takes effect, one set
    after the first bf16 product does not. True when this call set it."""
    if any(name in os.environ for name in ONEDNN_CACHE_VARIABLES):
        return False
    os.environ[ONEDNN_CACHE_VARIABLES[0]] = str(capacity)
    return True
