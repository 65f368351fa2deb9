"""Sum the oneDNN GEMMs a decoding process ran, from its ``ONEDNN_VERBOSE=1`` output (issue
99; one-off record): per kind (int8 / fp32) and part (the encoder's, M > 64 rows; the
decoder's and the attention's, M <= 64) the calls, milliseconds, multiply-adds and the
rate, then the costliest shapes. Both CTranslate2 (its bundled oneDNN) and PyTorch
(``torch._int_mm``) print these lines.

    ONEDNN_VERBOSE=1 python docs/performance/engine/perf_profile.py RUN DATA ct2 1 READY > ct2.log
    python docs/performance/engine/onednn_gemms.py ct2.log ranmt.log
"""

from __future__ import annotations

import collections
import re
import sys


def main() -> None:
    for path in sys.argv[1:]:
        parts = collections.defaultdict(lambda: [0, 0.0, 0])
        shapes = collections.defaultdict(lambda: [0, 0.0, 0])
        with open(path, encoding="utf-8", errors="replace") as log:
            lines = log.readlines()
        for line in lines:
            if ",exec," not in line:
                continue
            fields = line.strip().split(",")
            match = re.match(r"(\d+)x(\d+):(\d+)x(\d+)", fields[-2])
            if not match:
                continue
            m, k, n = int(match[1]), int(match[2]), int(match[4])
            source = re.search(r"src_(\w+?)::", line)
            kind = source[1] if source else "?"
            part = "encoder (M > 64)" if m > 64 else "decoder and attention (M <= 64)"
            for table, key in ((parts, (kind, part)), (shapes, (kind, fields[-2]))):
                entry = table[key]
                entry[0] += 1
                entry[1] += float(fields[-1])
                entry[2] += m * k * n
        print(path)
        for (kind, part), (calls, ms, macs) in sorted(parts.items()):
            print(f"  src {kind:4s} {part:32s} calls {calls:7d}  {ms:8.1f} ms  "
                  f"{macs / 1e9:7.2f} G MAC  {macs / ms / 1e6 if ms else 0:6.1f} G MAC/s")
        print("  costliest shapes (M x K : K x N):")
        for (kind, shape), (calls, ms, macs) in sorted(shapes.items(),
                                                       key=lambda kv: -kv[1][1])[:8]:
            print(f"    src {kind:4s} {shape:22s} calls {calls:6d}  {ms:8.1f} ms  "
                  f"{macs / ms / 1e6 if ms else 0:6.1f} G MAC/s")


if __name__ == "__main__":
    main()
