"""How far a run travels from its entry to the loss: the project modules it enters, its moves between them (and
how many go back up to a higher layer of docs' floor plan, /work/shared/design.md), and the frames on the stack
when the model family's loss is first called. Measured with ``sys.setprofile`` on the CPU demo (one optimizer
step, evaluation off), two entries:

- ``local``: what the flow's train task calls (``tasks/train.py`` -> ``train_local_run``), with a real MLflow
  tracker (a SQLite store in a temporary folder) as the task passes it;
- ``node``: ``fitburst train`` in one process (the cloud node's command: ``fitburst.cli.main``).

Only fitburst/, tasks/ and flows/ modules count (library frames are passed through). A move is a change of the
innermost project frame's module, on a call or a return; "up" is a move to a module of a higher layer.

    python benchmarks/call_path.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TMP = Path(tempfile.mkdtemp(prefix="fitburst-call-path-"))
os.environ.update({"MLFLOW_TRACKING_URI": f"sqlite:///{TMP / 'mlflow.db'}", "FITBURST_RUNS_DIR": str(TMP / "runs"),
                   "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
sys.path.insert(0, str(ROOT))

# the floor plan's layers (design.md), by module name; a module not named takes its package's row
LAYERS = {
    6: ["fitburst.cli", "flows", "tasks"],
    5: ["fitburst.preflight", "fitburst.supervisor", "fitburst.local", "fitburst.oom", "fitburst.ranks",
        "fitburst.cloud", "fitburst.tracking", "fitburst.outbox", "fitburst.rundir", "fitburst.init_adapter"],
    4: ["fitburst.recipe", "fitburst.train", "fitburst.builders", "fitburst.checkpoints", "fitburst.pace",
        "fitburst.evaluate", "fitburst.probe", "fitburst.meter", "fitburst.distributed", "fitburst.device",
        "fitburst.oom_errors", "fitburst.plots", "fitburst.history", "fitburst.hours"],
    3: ["fitburst.data", "fitburst.models", "fitburst.cache", "fitburst.demo_models", "fitburst.data_facts"],
    2: ["fitburst.families", "fitburst.memory", "fitburst.calibrate"],
    1: ["fitburst.spec", "fitburst.settings"],
    0: ["fitburst.hardware", "fitburst.errors", "fitburst.environ", "fitburst.logs", "fitburst.allocator_env",
        "fitburst"],
}


def layer(module: str) -> int:
    best, n = 0, -1
    for lay, names in LAYERS.items():
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > n:
                best, n = lay, len(name)
    return best


def module_of(code) -> str | None:
    """The project module a code object belongs to (fitburst/, tasks/, flows/), else None."""
    try:
        rel = Path(code.co_filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts[0] not in ("fitburst", "tasks", "flows") or rel.suffix != ".py":
        return None
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class CallPath:
    """The profile of one call of ``entry`` up to the first call of a family's ``train_loss``."""

    def __init__(self) -> None:
        self.modules: list[str] = []
        self.moves = self.up = 0
        self.current: str | None = None
        self.stack: list[str] | None = None  # project frames entry .. loss, at the loss
        self.frames = 0  # every frame, entry .. loss
        self.entry = None
        self.done = False

    def _move(self, to: str | None) -> None:
        if to is None or to == self.current:
            return
        if self.current is not None:
            self.moves += 1
            self.up += layer(to) > layer(self.current)
        self.current = to

    def _project_caller(self, frame) -> str | None:
        f = frame.f_back
        while f is not None and f is not self.entry.f_back:
            mod = module_of(f.f_code)
            if mod is not None:
                return mod
            f = f.f_back
        return None

    def __call__(self, frame, event, arg) -> None:
        if self.done or event not in ("call", "return"):
            return
        if self.entry is None:
            return
        mod = module_of(frame.f_code)
        if mod is None:
            return
        if event == "call":
            if mod not in self.modules:
                self.modules.append(mod)
            self._move(mod)
            if mod.startswith("fitburst.families") and frame.f_code.co_name == "train_loss":
                self._at_loss(frame)
        else:
            self._move(self._project_caller(frame))

    def _at_loss(self, frame) -> None:
        chain, f, frames = [], frame, 0
        while f is not None and f is not self.entry.f_back:
            frames += 1
            mod = module_of(f.f_code)
            if mod is not None:
                chain.append(f"{mod}.{f.f_code.co_name}")
            f = f.f_back
        self.stack, self.frames, self.done = chain[::-1], frames, True

    def run(self, entry: Callable[[], object]) -> None:
        def started():
            self.entry = sys._getframe()
            return entry()

        sys.setprofile(self)
        try:
            started()
        finally:
            sys.setprofile(None)


def demo():
    from fitburst.cache import cache_root
    from fitburst.data import prepare
    from fitburst.models import tokenizer_for
    from fitburst.spec import load_pipeline

    spec = load_pipeline(ROOT / "pipelines.yaml", "demo", {
        "training.max_steps": 1, "training.log_every": 1, "eval.enabled": False})
    return spec, prepare(spec.data, spec.data_path(), tokenizer_for(spec.model), cache_root() / "data")


def local_entry(spec, prepared) -> Callable[[], object]:
    from fitburst.tracking import Tracker

    try:
        from fitburst.supervisor import train_local_run
    except ImportError:  # main before issue #37's supervisor
        from fitburst.local import train_local_run  # type: ignore[no-redef]
    tracker = Tracker.start(spec)

    def entry():
        try:
            return train_local_run(spec, prepared, tracker, progress=False)
        finally:
            tracker.end()

    return entry


def node_entry(spec, prepared) -> Callable[[], object]:
    from fitburst.cli import main

    spec_file = TMP / "spec.yaml"
    spec_file.write_text(spec.to_yaml())
    return lambda: main(["train", "--spec", str(spec_file), "--prepared", str(prepared.dir), "--run-dir",
                         str(TMP / "node-run"), "--quiet"])


def main() -> None:
    import subprocess

    spec, prepared = demo()
    commit = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s"], capture_output=True,
                            text=True).stdout.strip()[:90]
    print(f"call path from the entry to the family's train_loss, CPU demo, one step ({commit})")
    print(f"{'entry':<6} {'modules':>7} {'moves':>5} {'up':>3} {'frames':>6} {'project frames':>14}  "
          "modules on the stack at the loss")
    stacks = []
    for name, make in (("local", local_entry), ("node", node_entry)):
        path = CallPath()
        path.run(make(spec, prepared))
        stack = path.stack or []
        on_stack = list(dict.fromkeys(s.rsplit(".", 1)[0] for s in stack))
        print(f"{name:<6} {len(path.modules):>7} {path.moves:>5} {path.up:>3} {path.frames:>6} {len(stack):>14}  "
              f"{len(on_stack)}")
        stacks.append((name, stack, path.modules))
    for name, stack, modules in stacks:
        print(f"\n{name}: stack at the loss (layer, module.function)")
        for s in stack:
            print(f"  {layer(s.rsplit('.', 1)[0])}  {s}")
        print(f"{name}: modules entered: {', '.join(modules)}")


if __name__ == "__main__":
    main()
