"""Operators a training step dispatches, by phase: what a launch-bound GPU step pays for.

A ``base`` step on a GPU at 16k tokens is launch-bound (docs/PERFORMANCE.md "On a GPU"):
the host spends longer issuing kernels than the GPU spends running them. Every aten
operator that computes (not a view: ``view``, ``t``, ``transpose``, ``expand``, ...) is a
kernel launch on a GPU, and the count is the same on any device, so it is measured here on
the CPU with a ``TorchDispatchMode`` (``ranmt.runtime.host_syncs.SyncCounter``): forward, loss +
backward, optimizer, each precision as :class:`ranmt.runtime.precision.PrecisionPolicy` runs it on
``--policy-device`` (cuda: plain bf16 autocast; cpu: with bf16 residual streams), and each
Adam implementation (``single``: one tensor at a time, the CPU default; ``foreach``: the
CUDA default before the policy; ``fused``: one kernel, what the policy picks on CUDA).
``bf16-weights`` (:mod:`ranmt.training.master`) updates one flat fp32 master tensor;
``casts``: the step's dtype conversions (``_to_copy``).
Counts are deterministic (a machine under load gives the same). With ``--policy-device
cuda`` dropout is counted as CUDA runs it: ``F.dropout`` in training is one fused kernel
there (``native_dropout``; its backward one more), where the CPU draws a Bernoulli mask,
divides and multiplies (4 operators), so ``F.dropout`` is routed to ``torch.native_dropout``
while counting.

    python benchmarks/count_ops.py --preset base --arch transf ran-all hc-sa
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from ranmt.config import load_config
from ranmt.model import build_model
from ranmt.runtime.host_syncs import OpCounter
from ranmt.runtime.precision import PrecisionPolicy, bf16_activations
from ranmt.training.loss import label_smoothed_loss
from ranmt.training.master import MasterWeights


@contextlib.contextmanager
def dropout_as_on(device_type: str):
    """Within: ``F.dropout`` dispatches what it dispatches on ``device_type`` (on CUDA the
    fused ``native_dropout`` for 0 < p < 1 in training; elsewhere unchanged)."""
    if device_type != "cuda":
        yield
        return
    cpu_dropout = F.dropout

    def fused_dropout(x, p=0.5, training=True, inplace=False):
        if training and 0.0 < p < 1.0 and x.numel() > 0:
            return torch.native_dropout(x, p, True)[0]
        return cpu_dropout(x, p, training, inplace)

    F.dropout = fused_dropout
    try:
        yield
    finally:
        F.dropout = cpu_dropout


def step_counts(arch: str, preset: str, precision: str, device_type: str, adam: str,
                sentences: int, length: int, vocab: int) -> dict[str, int]:
    """Kernels of each phase of the second training step."""
    cfg = load_config(None, {"model.preset": preset, "model.arch": arch,
                             "model.src_vocab_size": str(vocab),
                             "model.tgt_vocab_size": str(vocab), "model.joint_vocab": "true"})
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    options = {"single": {"foreach": False}, "foreach": {"foreach": True},
               "fused": {"fused": True}}[adam]
    policy = PrecisionPolicy(precision, device_type)
    masters = MasterWeights(model, policy.weights_dtype) if policy.weights_dtype else None
    optimizer = torch.optim.Adam(masters.parameters() if masters else model.parameters(),
                                 lr=1e-4, **options)
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab, (sentences, length), generator=gen)
    tgt = torch.randint(4, vocab, (sentences, length + 1), generator=gen)
    counts: dict[str, int] = {}

    def step(counter: OpCounter | None) -> None:
        optimizer.zero_grad(set_to_none=True)
        if masters:
            masters.zero_grad()
        marks = [0]
        # a policy for another device type is run with the CPU's autocast (same op list)
        with torch.autocast("cpu", dtype=policy.autocast_dtype,
                            enabled=policy.autocast_dtype is not None), \
                bf16_activations(policy.bf16_residual_stream):
            logits = model(src, tgt[:, :-1])
        marks.append(counter.kernels() if counter else 0)
        loss, _ = label_smoothed_loss(logits, tgt[:, 1:], 0.1)
        loss.backward()
        marks.append(counter.kernels() if counter else 0)
        if masters:
            masters.to_master()
        optimizer.step()
        if masters:
            masters.to_model()
        marks.append(counter.kernels() if counter else 0)
        if counter:
            counts.update(forward=marks[1], backward=marks[2] - marks[1],
                          optimizer=marks[3] - marks[2], total=marks[3],
                          casts=counter.names["_to_copy"])

    with dropout_as_on(device_type):
        step(None)  # the first step allocates the optimizer state
        with OpCounter() as counter:
            step(counter)
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", default=["transf", "ran-all"])
    p.add_argument("--preset", default="base")
    p.add_argument("--policy-device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--adam", nargs="+", default=["single", "foreach", "fused"])
    p.add_argument("--sentences", type=int, default=16)
    p.add_argument("--length", type=int, default=20)
    p.add_argument("--vocab", type=int, default=8000)
    args = p.parse_args(argv)
    print(f"{args.preset}, precision as on {args.policy_device}, torch {torch.__version__}; "
          "kernels = dispatched aten ops that are not views")
    print("| arch | precision | Adam | forward | loss + backward | optimizer | total | casts |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for arch in args.arch:
        for precision in args.precision:
            for adam in args.adam:
                c = step_counts(arch, args.preset, precision, args.policy_device, adam,
                                args.sentences, args.length, args.vocab)
                print(f"| {arch} | {precision} | {adam} | {c['forward']} | {c['backward']} "
                      f"| {c['optimizer']} | {c['total']} | {c['casts']} |")


if __name__ == "__main__":
    main()
