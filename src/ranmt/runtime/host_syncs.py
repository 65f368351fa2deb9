"""Counting host-device synchronisations by the operators that cause them (and, with
:class:`OpCounter`, every operator: the kernels a GPU step would launch).

On a GPU, an operator whose result the host must read before it can go on (``.item()``,
``bool(tensor)``, ``int(tensor)``, ``nonzero()``, boolean-mask indexing, ``masked_select``,
``repeat_interleave`` by a tensor of counts without ``output_size``) makes the host wait
until every kernel queued before it has run: the GPU then idles while the host issues the
next kernels. The same operators are dispatched on the CPU, so counting them there (a
``TorchDispatchMode`` that sees every aten call) tells how often a search would stall a GPU,
without one. Ops are counted as dispatched at the Python level: an op called inside another
op's kernel is not seen, which is why boolean-mask indexing is counted by its arguments.

    with SyncCounter() as syncs:
        beam_search(model, src, ...)
    syncs.total, syncs.by_op
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {"nonzero", "nonzero_static_", "masked_select", "unique",
           "_unique2", "unique_consecutive", "argwhere", "nonzero_numpy"}
"""Operators whose output (or its size) depends on device values: always a sync."""


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else None
    return isinstance(indices, (list, tuple)) and any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        for index in indices)


def is_sync(func, args, kwargs) -> bool:
    """True when aten operator ``func`` called with ``args``/``kwargs`` needs a device value
    on the host (see the module docstring)."""
    name = func._schema.name.split("::")[-1]
    if name in _ALWAYS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return _has_bool_index(args)
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if not isinstance(repeats, torch.Tensor) and len(args) == 1:
            repeats = args[0]  # repeat_interleave(repeats) overload
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


_HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist")
"""``torch.Tensor`` methods that hand a tensor's value to the host."""


class SyncCounter(TorchDispatchMode):
    """Counts the host syncs (``total``, ``by_op``: aten operator or Tensor method name) and
    all dispatched aten ops (``ops``) of the code run inside it (one thread)."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.ops = 0
        self._saved: dict[str, object] = {}  # name -> the method torch.Tensor itself had

    def __enter__(self):
        for name in _HOST_READS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, own in self._saved.items():
            if own is None:  # inherited from torch._C.TensorBase: inherit it again
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)
        self._saved.clear()
        return super().__exit__(*exc)

    def _counting(self, name: str, original):
        counter = self

        def read(tensor, *args, **kwargs):
            counter.by_op[name] += 1
            return original(tensor, *args, **kwargs)

        return read

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if is_sync(func, args, kwargs):
            self.by_op[func._schema.name.split("::")[-1]] += 1
        return func(*args, **kwargs)


VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "unsqueeze", "squeeze",
         "permute", "as_strided", "alias", "detach", "slice", "select", "split",
         "split_with_sizes", "chunk", "unbind", "narrow", "reshape", "_reshape_alias",
         "unflatten", "flatten", "view_as", "expand_as", "contiguous", "lift_fresh",
         "_local_scalar_dense", "is_same_size", "sym_size", "sym_stride", "sym_numel"}
"""Operators that change metadata only (no kernel on a GPU), and host reads."""


class OpCounter(TorchDispatchMode):
    """Counts every dispatched aten operator by name (``names``); :meth:`kernels` is the
    number that would be kernel launches on a GPU (``benchmarks/count_ops.py``)."""

    def __init__(self):
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))

    def kernels(self) -> int:
        return sum(count for name, count in self.names.items() if name not in VIEWS)
