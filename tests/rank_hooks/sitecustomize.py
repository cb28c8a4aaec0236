"""Test instrumentation for the ranks torchrun starts (they cannot be monkeypatched from the test process): with
this folder on PYTHONPATH and FITBURST_TEST_RANK_HOOKS set to JSON, every rank wraps the step its loop calls
(fitburst.recipe.optimizer_step) as the recipe is imported (by fitburst.torchrun before it forks the ranks):

    step_sleep   seconds added to each optimizer step, so a test can act mid-run
    oom          {"rank": r, "call": k, "marker": path}: rank r's k-th optimizer step (0-based) fails with the CPU
                 allocator's out-of-memory error once (the marker file, created then, stops it happening again)
    pids         a folder: each rank writes rank-<r>.pid there (its process id) as it takes its first step
    held         a folder: each rank writes rank-<r>.json there, the bytes of parameter storage it holds when
                 fitburst.builders has loaded the base model ("loaded": meta tensors hold none) and when build_model
                 returns ("built": a sharded parameter's local shard), and which of bitsandbytes and scikit-learn
                 the rank had imported by then ("imported"), and the command line its interpreter was started with
                 ("command": a forked rank holds its launcher's, python -m fitburst.torchrun; a spawned rank
                 multiprocessing's spawn_main; a rank torchrun started, python -u -m fitburst.cli)
    cuda_asked   true: fitburst.torchrun's launcher finds that a forked rank could not use CUDA (as where an import
                 asked the CUDA driver), so it spawns the ranks
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
        if CONFIG.get("pids") and calls == 0:
            with open(os.path.join(CONFIG["pids"], f"rank-{os.environ.get('RANK', '0')}.pid"), "w") as f:
                f.write(str(os.getpid()))
        time.sleep(CONFIG.get("step_sleep", 0))
        oom = CONFIG.get("oom")
        if oom and int(os.environ.get("RANK", "0")) == oom["rank"] and calls == oom["call"] and not os.path.exists(
                oom["marker"]):
            open(oom["marker"], "w").close()
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 268435456 bytes.")
        calls += 1
        return real(*a, **k)

    module.optimizer_step = optimizer_step
    if CONFIG.get("cuda_asked") and "fitburst.torchrun" in sys.modules and "RANK" not in os.environ:  # its launcher
        sys.modules["fitburst.torchrun"]._cuda_refused_after_fork = lambda: True
    if CONFIG.get("held"):
        _record_held(module, CONFIG["held"])


def _held(model) -> int:
    total = 0
    for p in model.parameters():  # a tied weight once
        t = p.to_local() if hasattr(p, "to_local") else p
        total += 0 if t.is_meta else t.numel() * t.element_size()
    return total


def _record_held(module, folder: str) -> None:
    import fitburst.builders as builders  # loaded with the recipe: where build_model loads the base model

    load, build = builders.load_pipeline_model, module.build_model
    seen: dict = {}

    def write() -> None:
        with open(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(seen, f)

    def load_pipeline_model(*a, **k):
        model = load(*a, **k)
        seen["loaded"] = _held(model)
        write()
        return model

    def build_model(*a, **k):
        out = build(*a, **k)
        seen["built"] = _held(out[0])
        seen["imported"] = sorted(n for n in ("bitsandbytes", "sklearn") if sys.modules.get(n) is not None)
        seen["command"] = " ".join(sys.orig_argv[1:])
        write()
        return out

    builders.load_pipeline_model = load_pipeline_model
    module.build_model = build_model


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "fitburst.recipe":
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
