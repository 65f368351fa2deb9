"""One-off experiment (issue 99, 2026-12-05, night): what inductor's generated wrapper code
costs a compiled search at Bergamot's setting (trained int8 TransF student + shortlist,
greedy, batch 32, one thread, fixed length 20, 320 test_2016 sentences), where perf puts
17.6% of ranmt's time in Python and torch's Python binding (docs/PERFORMANCE.md, "Where
CTranslate2's lead comes from, profiled"). Configurations, all in one process (each
compiles its own copy of the step and encoder functions: Dynamo caches graphs by code
object), their timed rounds alternating:

* ``default``: ``decode.compile_step`` as shipped (Python wrapper, size asserts on);
* ``no_size_asserts``: inductor's ``size_asserts`` off (the wrapper checks no input's
  size and stride: ~74 ``assert_size_stride`` calls a step);
* ``cpp_wrapper``: inductor's C++ wrapper (the code that calls the kernels is C++).

    python docs/performance/engine/wrapper_overhead.py RUN DATA [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
from perf_profile import bergamot_args  # noqa: E402  (this folder's)

from ranmt.inference import graphs  # noqa: E402
from ranmt.runtime.precision import cpu_description  # noqa: E402


def _body_default(body):
    body()


def _body_no_size_asserts(body):
    body()


def _body_cpp_wrapper(body):
    body()


def _encode_default(model, src):
    return model.encode(src)


def _encode_no_size_asserts(model, src):
    return model.encode(src)


def _encode_cpp_wrapper(model, src):
    return model.encode(src)


CONFIGS = {
    "default": (_body_default, _encode_default, {}),
    "no_size_asserts": (_body_no_size_asserts, _encode_no_size_asserts,
                        {"size_asserts": False}),
    "cpp_wrapper": (_body_cpp_wrapper, _encode_cpp_wrapper, {"cpp_wrapper": True}),
}


def main() -> None:
    run, data = sys.argv[1:3]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    torch.set_num_threads(1)
    print(cpu_description(), torch.__version__, flush=True)
    args = bergamot_args(run, data)
    builders, transf = peers._decode_systems(args, Path("/tmp/wrapper_overhead"))
    decode = builders["ranmt TransF int8 compiled + shortlist"]()
    _, batches = peers._source_batches(args, transf)
    compiled = {}
    for name, (body, encode, extra) in CONFIGS.items():
        options = {"freezing": True, **extra}
        compiled[name] = (
            torch.compile(body, fullgraph=True, dynamic=False, options=options),
            torch.compile(encode, **graphs.CompiledStep.ENCODER_TRACE, options=options))
    seconds: dict[str, list[float]] = {name: [] for name in CONFIGS}
    outputs = {}
    with torch.inference_mode():
        for repeat in range(rounds + 1):  # round 0: compiles
            for name in CONFIGS:
                graphs.CompiledStep._runner, graphs.CompiledStep._encoder = compiled[name]
                start = time.perf_counter()
                outputs[name] = [decode(batch) for batch in batches]
                elapsed = time.perf_counter() - start
                if repeat:
                    seconds[name].append(elapsed)
                else:
                    print(f"{name}: first round (compiling) {elapsed:.1f} s", flush=True)
    for name, values in seconds.items():
        same = outputs[name] == outputs["default"]
        print(f"{name:16s} median {1000 * statistics.median(values) / 320:.3f} ms/sentence, "
              f"best {1000 * min(values) / 320:.3f} (rounds: "
              f"{', '.join(f'{v:.3f}' for v in values)} s); outputs as default: {same}")


if __name__ == "__main__":
    main()
