"""benchmarks/compiled_step.py: its opaque int8 layer is the int8 layer it replaces, and its
compiled sync-free step gives the eager search's hypotheses (fp32) on a tiny model."""

from __future__ import annotations

import functools

import pytest
from torch._dynamo.utils import counters

from conftest import assert_same_hypotheses, load_script, random_batch, tiny_model
from ranmt.inference.decode import search
from ranmt.inference.quantize import quantize_model


@functools.cache
def bench():
    """The script, loaded once (it registers a custom operator, which can happen only once)."""
    return load_script("benchmarks/compiled_step.py")


def test_opaque_int8_layers_decode_as_the_int8_layers_they_replace():
    model = quantize_model(tiny_model(seed=1)[0], "int8")
    src = random_batch(batch=4)[0]
    before = search(model, src, beam=2, fixed_length=5)
    assert bench().make_opaque(model) > 0
    assert search(model, src, beam=2, fixed_length=5) == before


@pytest.mark.slow
def test_the_compiled_step_gives_the_eager_hypotheses_in_fp32():
    model = tiny_model(seed=2)[0]
    src = random_batch(batch=4)[0]
    eager = search(model, src, beam=1, fixed_length=6)
    with bench().compiled_steps():
        compiled = search(model, src, beam=1, fixed_length=6, sync_free=True, cuda_graphs=True)
        graphs = counters["stats"]["unique_graphs"]
        again = search(model, src, beam=1, fixed_length=6, sync_free=True, cuda_graphs=True)
    assert_same_hypotheses(compiled, eager)
    assert_same_hypotheses(again, eager)
    assert counters["stats"]["unique_graphs"] == graphs  # a new batch, same shape: no recompile
