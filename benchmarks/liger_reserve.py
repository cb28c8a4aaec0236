"""Where Liger's model kernels save memory in the best plan's trace at the 24 GB row's longest context.

Usage: PYTHONPATH=$PWD python benchmarks/liger_reserve.py > benchmarks/results/liger_reserve.txt

Llama-3.1-8B QLoRA, the plan benchmarks/context_fit.py chooses at its 24 GB row's longest length, traced without
and with Liger's kernels as fitburst.memory.trace.traced_estimate traces it (CUDA's rules applied, the caching
allocator replayed in this process's allocator mode). For each: the allocated (tensor) peak and its phase, the
reserved peak, and every step of the replay at which reserved grows by more than 256 MiB, with the ops that
allocated just before it; the growths one trace has and the other has not are where the reserved figures part.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from context_fit import best, card, plain  # noqa: E402

from fitburst.allocator_env import allocator_mode  # noqa: E402
from fitburst.hardware import GiB, MiB  # noqa: E402
from fitburst.memory import cuda_kernels  # noqa: E402
from fitburst.memory.allocator import CachingAllocator  # noqa: E402
from fitburst.memory.shapes import load_shape  # noqa: E402
from fitburst.memory.trace import trace_step  # noqa: E402
from fitburst.memory.trace_events import live_peaks  # noqa: E402
from fitburst.spec import PipelineSpec  # noqa: E402

LENGTH, CARD_GB = 91_776, 24  # benchmarks/results/context_fit_traced.txt: the 24 GB row's analytic longest


def growths(events, expandable: bool) -> tuple[int, list[tuple[int, int]]]:
    """(reserved peak, [(event index, bytes reserved grew by)]) of the allocator's replay over every event."""
    a = CachingAllocator(expandable=expandable)
    handles: dict[int, int] = {}
    grown = []
    for i, e in enumerate(events):
        if e.kind == "empty_cache":
            a.empty_cache()
        elif e.size and e.kind == "alloc":
            before = a.reserved
            handles[e.sid] = a.malloc(e.size)
            if a.reserved - before > 256 * MiB:
                grown.append((i, a.reserved - before))
        elif e.size and e.sid in handles:
            a.free(handles.pop(e.sid))
    return a.peak_reserved, grown


def main() -> int:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# liger_reserve: commit {commit}, load average {os.getloadavg()[0]:.2f} (2-core box, shared), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, allocator mode {allocator_mode()}")
    shape, dev = load_shape("llama-3.1-8b"), card(CARD_GB)
    spec = PipelineSpec.model_validate(dict(name="b", model=dict(name="llama-3.1-8b"), data=dict(path="x.jsonl"),
                                            method=dict(type="qlora", quant="nf4", rank=32, double_quant=True)))
    plan = best(plain(LENGTH), CARD_GB, shape)
    print(f"# plan: {plan.describe()}")
    t0 = time.time()
    for on in (False, True):
        s = replace(plan, liger_kernels=on)
        trace = trace_step(spec, s, seq_len=LENGTH, adamw=cuda_kernels.adamw_impl("cuda", 1, s.adamw),
                           autocast_of="cuda", device=dev)
        events, start = cuda_kernels.apply(trace, dev, s, LENGTH, device_map=True)
        peak, phase, _ = live_peaks(events, start)
        reserved, grown = growths(events, allocator_mode() == "expandable_segments")
        print(f"\n## Liger {'on' if on else 'off'}: allocated peak {peak / GiB:.3f} GiB ({phase}), reserved peak "
              f"{reserved / GiB:.3f} GiB, device total {(reserved + dev.outside_allocator) / GiB:.2f} GiB\n")
        print("| event | phase | reserved grows GiB | the allocation (op, GiB) and the four before it |")
        print("|---:|---|---:|---|")
        for i, grew in grown:
            ops = ", ".join(f"{e.op.split('.')[0]} {e.size / GiB:.2f}" for e in events[max(0, i - 8):i + 1]
                            if e.kind == "alloc")
            ops = ", ".join(ops.split(", ")[-5:])
            print(f"| {i:,} | {events[i].phase} | {grew / GiB:.3f} | {ops} |")
    print(f"\n# {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
