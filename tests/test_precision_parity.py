"""Reduced-precision decoding picks (almost) what fp32 picks: the int8 copy and the bf16
model against fp32 on a trained checkpoint (the reverse task), same beam search.

The tolerances are measured noise with room (AMD EPYC Zen 4 with AVX512-BF16, torch
2.13.0 CPU, this fixture's 600-step model, 200 held-out lines, beam 4): int8 kept 200/200
best hypotheses, score difference (length-normalised log-probability) mean 0.0093, largest
0.19; bf16 kept 200/200, mean 0.0026, largest 0.024. The bounds allow about 3x that
(a share of 0.97 / 0.95); a copy decoding with wrong weights or scales falls far outside.
"""

from __future__ import annotations

import pytest

from ranmt.data.corpus import raw_text
from ranmt.inference.translator import Translator
from ranmt.runtime.precision import cpu_bf16_support

# (least share of identical best hypotheses, largest mean and largest |score difference|
# where identical)
TOLERANCES = {"int8": (0.97, 0.03, 0.5), "bf16": (0.95, 0.01, 0.1)}


def _decode(run, lines, **options):
    translator = Translator.load(run, device="cpu", beam=4, **options)
    return [hyps[0] for hyps in translator.translate_detailed(lines)]


def _compare(reference, other) -> tuple[float, float, float]:
    """(share of identical best hypotheses, mean and largest |score difference| of those)."""
    same = [abs(a.score - b.score) for a, b in zip(reference, other) if a.text == b.text]
    return len(same) / len(reference), sum(same) / len(same), max(same)


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_reduced_precision_decodes_like_fp32(reverse_run, reverse_data, kind):
    lines = raw_text(reverse_data, "test", "src")
    options = {"quantize": "int8"} if kind == "int8" else {"precision": "bf16"}
    if kind == "bf16" and not cpu_bf16_support()[0]:
        with pytest.raises(ValueError, match="bf16 on this CPU"):  # refused, not emulated
            Translator.load(reverse_run, device="cpu", **options)
        return
    reference = _decode(reverse_run, lines)
    share, mean, worst = _compare(reference, _decode(reverse_run, lines, **options))
    print(f"{kind}: {share:.3f} of best hypotheses identical, score difference mean "
          f"{mean:.4f}, largest {worst:.4f}")
    least_share, largest_mean, largest = TOLERANCES[kind]
    assert share >= least_share and mean <= largest_mean and worst <= largest
    assert worst > 0  # it did decode in another precision
