"""Training step time of every recurrent cross-attention variant relative to dot-product.

All systems are built in one process from the same config (only
``model.decoder.cross_attention`` differs), trained on the *same* batches, and timed
interleaved (round-robin) so machine noise hits them alike. The baseline runs twice, first
and last in every round (``dot`` and ``dot'``): the gap between the two shows how much of a
ratio is order effect or noise rather than the variant. Prints, per variant, the median
step time and its ratio to the baseline (the paper's Table 2, last column, reports 5.4x-7.9x
for its step-through-the-decoder implementation).

    python benchmarks/recurrent_cross_speed.py --preset small --data data/m30k-en-de
    python benchmarks/recurrent_cross_speed.py --preset tiny            # synthetic batch
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from ranmt.config import load_config
from ranmt.data.batching import batch_from_split, collate, make_batches
from ranmt.model import build_model
from ranmt.training.train import label_smoothed_loss

SYSTEMS = [
    ("dot", {}),
    ("concat-prev-context", {}),
    ("concat-prev-weight", {}),
    ("concat-prev-accum-weight", {}),
    ("expand-kv", {"model.recurrent_cross.expand_kv_variant": 1}),
    ("expand-kv", {"model.recurrent_cross.expand_kv_variant": 2}),
    ("expand-kv", {"model.recurrent_cross.expand_kv_variant": 3}),
    ("expand-kv", {"model.recurrent_cross.expand_kv_variant": 4}),
    ("smooth-energy", {}),
    ("coverage-subtract", {}),
    ("dot", {}),  # the baseline again, last in each round: shows order effects and noise
]


def batches_for(args, vocab: int):
    if args.data:
        from ranmt.data.corpus import load_split

        split = load_split(args.data, "train")
        lengths = np.array([len(s) for s in split.src]), np.array([len(t) for t in split.tgt])
        chosen = make_batches(*lengths, args.max_tokens, seed=1, epoch=0, noise=0.5)
        return [batch_from_split(split, b) for b in chosen[: args.batches]]
    rng = np.random.default_rng(0)
    out = []
    for _ in range(args.batches):
        n = max(1, args.max_tokens // 24)
        src = [rng.integers(4, vocab, rng.integers(8, 23)) for _ in range(n)]
        tgt = [rng.integers(4, vocab, rng.integers(8, 23)) for _ in range(n)]
        out.append(collate(src, tgt, np.arange(n)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--data", help="prepared data (default: synthetic batches)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=4, help="distinct batches cycled")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after 1 warm-up)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)

    vocab = 8000
    if args.data:
        from ranmt.data.corpus import load_meta

        vocab = load_meta(args.data)["src_vocab_size"]
    systems = []
    for name, extra in SYSTEMS:
        overrides = {"model.preset": args.preset, "model.src_vocab_size": vocab,
                     "model.tgt_vocab_size": vocab, "model.joint_vocab": "true",
                     "model.decoder.cross_attention": name, **extra}
        cfg = load_config(None, {k: str(v) for k, v in overrides.items()})
        torch.manual_seed(0)
        model = build_model(cfg.model).to(device).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        variant = extra.get("model.recurrent_cross.expand_kv_variant")
        label = name + (f"-{variant}" if variant else "")
        while label in [existing for existing, _, _ in systems]:
            label += "'"  # a repeated system (e.g. the baseline again, as a noise control)
        systems.append((label, model, optimizer))
    batches = [b.to(device) for b in batches_for(args, vocab)]

    def train_step(model, optimizer, batch) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss, _ = label_smoothed_loss(model(batch.src, batch.tgt_in), batch.tgt_out, 0.1)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {label: [] for label, _, _ in systems}
    for round_index in range(args.rounds + 1):
        for batch in batches:
            for label, model, optimizer in systems:  # interleaved: same batch, back to back
                elapsed = train_step(model, optimizer, batch)
                if round_index > 0:
                    times[label].append(elapsed)
    baseline = statistics.median(times["dot"])
    tokens = statistics.mean(int(b.tgt_out.ne(0).sum()) for b in batches)
    print(f"device {device}, preset {args.preset}, {len(batches)} batches of ~{tokens:.0f} "
          f"target tokens, {args.rounds} rounds, torch {torch.__version__}")
    print(f"{'variant':<28}{'median step (ms)':>18}{'ratio to dot':>14}")
    results = {}
    for label, _, _ in systems:
        median = statistics.median(times[label])
        results[label] = {"median_step_s": median, "ratio": median / baseline}
        print(f"{label:<28}{median * 1000:>18.1f}{median / baseline:>14.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"device": str(device), "preset": args.preset, "results": results},
                      handle, indent=1)


if __name__ == "__main__":
    main()
