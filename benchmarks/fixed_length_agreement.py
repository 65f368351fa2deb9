"""Why ranmt and CTranslate2 pick different beams at a fixed output length. Not a test.

``benchmarks/peers.py --fixed-length L`` makes every system write exactly L tokens, so that
checkpoints do the same work. With a trained model and beam 4, CTranslate2's best hypotheses
then equal ranmt's in only a quarter to a third of the sentences (greedy: 92-100%). The two
define the score of a forced-length hypothesis differently (CTranslate2 4.x,
``src/decoding.cc``):

* CTranslate2 disables EOS on the *logits* before its log-softmax (``apply_min_length`` +
  ``DisableTokens``), so each step's log-probabilities are renormalised over the other
  tokens; ranmt sets EOS's *log-probability* to -inf, so a step where EOS was likely costs
  what EOS would have taken;
* CTranslate2 ends every hypothesis at its L-th token with no EOS (``is_last_step``); ranmt
  forces EOS after L tokens and adds its log-probability.

Neither changes a greedy arg-max, both change which beam wins. This script decodes the same
sentences with CTranslate2 and with ranmt's beam search under each definition (ranmt's own,
and CTranslate2's, as a step processor in place of ranmt's length processors), with the
length penalty off so that scores are summed log-probabilities, and prints how often the
best hypotheses agree and how far the scores of agreeing ones differ. If the definitions
are the whole story, ranmt under CTranslate2's definition agrees with CTranslate2 on (nearly) every
sentence, and scores match to float32 rounding.

    python benchmarks/fixed_length_agreement.py --run RUN --data DATA --ct2 CT2_DIR \\
        --sentences 320 --batch 100 --beam 4 --fixed-length 20 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ranmt.data.batching import pad_sources
from ranmt.data.corpus import raw_text
from ranmt.inference import decode
from ranmt.inference.processors import (
    PROCESSORS,
    Processor,
    register_processor,
    unregister_processor,
)
from ranmt.inference.translator import Translator
from ranmt.model import EOS_ID
from ranmt.runtime.precision import cpu_description


class CT2FixedLength(Processor):
    """CTranslate2's forced length as a ranmt step processor, in place of ranmt's own
    (``fixed_length`` and ``length_limit``): before the fixed length EOS is removed and the
    rest renormalised (a log-softmax without EOS); at the fixed length the hypothesis ends
    at no cost (EOS with log-probability 0)."""

    name, order = "ct2_fixed_length", 10

    def __init__(self, length: int):
        self.length = length

    @classmethod
    def build(cls, options, fixed_length):
        if fixed_length is None:
            raise ValueError("only with a fixed length")
        return cls(fixed_length)

    def __call__(self, logprobs: torch.Tensor, rows) -> None:
        if rows.prefix is not None:
            raise ValueError("only a fixed length, without prefixes")
        if rows.step < self.length:
            logprobs[:, EOS_ID] = float("-inf")
            logprobs.sub_(torch.logsumexp(logprobs, dim=-1, keepdim=True))
        else:
            logprobs.fill_(float("-inf"))
            logprobs[:, EOS_ID] = 0.0


def ranmt_best(model, batches, beam: int, fixed_length: int, definition: str) -> list:
    """Best (tokens, score) per sentence from ranmt's shrinking beam search (greedy at beam
    1) under ``definition`` ("ranmt" or "ctranslate2": its processor registered in place of
    ranmt's length processors for the call)."""
    replaced = [PROCESSORS[name] for name in ("fixed_length", "length_limit")]
    if definition == "ctranslate2":
        for processor in replaced:
            unregister_processor(processor.name)
        register_processor(CT2FixedLength)
    try:
        best = []
        for batch in batches:
            hyps = decode.search(model, pad_sources(batch), beam=beam, lenpen=0.0,
                                 lenpen_style="fairseq", max_len_a=0.0,
                                 max_len_b=fixed_length, nbest=1, fixed_length=fixed_length)
            best += [h[0] for h in hyps]
        return best
    finally:
        if definition == "ctranslate2":
            unregister_processor(CT2FixedLength.name)
            for processor in replaced:
                register_processor(processor)


def ct2_best(engine, translator: Translator, batches, beam: int, fixed_length: int) -> list:
    """Best (tokens, score) per sentence from CTranslate2 (scores: summed log-probs)."""
    src = translator.src_vocab.processor
    tgt = translator.tgt_vocab.processor
    pieces = [src.id_to_piece(i) for i in range(src.get_piece_size())]
    best = []
    for batch in batches:
        results = engine.translate_batch(
            [[pieces[i] for i in s] for s in batch], beam_size=beam, length_penalty=0.0,
            min_decoding_length=fixed_length, max_decoding_length=fixed_length,
            return_scores=True)
        best += [([tgt.piece_to_id(p) for p in r.hypotheses[0]], r.scores[0])
                 for r in results]
    return best


def agreement(mine: list, theirs: list) -> dict:
    same = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a[0] == b[0]]
    gaps = [abs(mine[i][1] - theirs[i][1]) for i in same]
    return {"same_best": len(same) / len(mine),
            "max_score_gap_where_same": max(gaps) if gaps else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a trained TransF run folder")
    parser.add_argument("--ct2", required=True,
                        help="that run exported with `ranmt export --format ctranslate2`")
    parser.add_argument("--data", required=True, help="the prepared data of the run")
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--sentences", type=int, default=320)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--beam", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--fixed-length", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the numbers here too")
    args = parser.parse_args(argv)
    import ctranslate2

    torch.set_num_threads(args.threads)
    translator = Translator.load(args.run, device="cpu")
    model = translator.model.eval()
    engine = ctranslate2.Translator(args.ct2, device="cpu", compute_type="float32",
                                    intra_threads=args.threads)
    ids = translator.src_vocab.encode(raw_text(args.data, args.split, "src")[:args.sentences])
    ids = [s for s in ids if s]
    batches = [ids[i:i + args.batch] for i in range(0, len(ids), args.batch)]
    result = {"cpu": cpu_description(), "torch": torch.__version__,
              "ctranslate2": ctranslate2.__version__, "sentences": len(ids),
              "fixed_length": args.fixed_length, "batch": args.batch, "beams": {}}
    for beam in args.beam:
        theirs = ct2_best(engine, translator, batches, beam, args.fixed_length)
        row = {definition: agreement(ranmt_best(model, batches, beam, args.fixed_length,
                                                definition), theirs)
               for definition in ("ranmt", "ctranslate2")}
        result["beams"][beam] = row
        for definition, numbers in row.items():
            gap = numbers["max_score_gap_where_same"]
            print(f"beam {beam}, ranmt under {definition}'s definition: best hypothesis = "
                  f"CTranslate2's in {100 * numbers['same_best']:.1f}% of "
                  f"{len(ids)} sentences; largest score gap where equal "
                  f"{'-' if gap is None else f'{gap:.2e}'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
