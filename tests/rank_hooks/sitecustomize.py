"""Test instrumentation for the ranks torchrun starts (they cannot be monkeypatched from the test process): with
this folder on PYTHONPATH and FITBURST_TEST_RANK_HOOKS set to JSON, every rank wraps fitburst.train.optimizer_step
as it is imported:

    step_sleep   seconds added to each optimizer step, so a test can act mid-run
    oom          {"rank": r, "call": k, "marker": path}: rank r's k-th optimizer step (0-based) fails with the CPU
                 allocator's out-of-memory error once (the marker file, created then, stops it happening again)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import time

CONFIG = json.loads(os.environ.get("FITBURST_TEST_RANK_HOOKS") or "null")


def _wrap(module) -> None:
    real = module.optimizer_step
    calls = 0

    def optimizer_step(*a, **k):
        nonlocal calls
        time.sleep(CONFIG.get("step_sleep", 0))
        oom = CONFIG.get("oom")
        if oom and int(os.environ.get("RANK", "0")) == oom["rank"] and calls == oom["call"] and not os.path.exists(
                oom["marker"]):
            open(oom["marker"], "w").close()
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 268435456 bytes.")
        calls += 1
        return real(*a, **k)

    module.optimizer_step = optimizer_step


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "fitburst.train":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            _wrap(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if CONFIG:
    sys.meta_path.insert(0, _Hook())
