"""How far a run travels from its entry to the loss, measured with ``sys.setprofile`` on the CPU demo (one optimizer
step, evaluation off), two ways:

1. **Every project frame** (the first table): the project modules the run enters, its moves between them (and how
   many go back up to a higher layer of docs' floor plan, /work/shared/design.md), and the frames on the stack when
   the model family's loss is first called. A move is a change of the innermost project frame's module, on a call
   or a return; "up" is a move to a module of a higher layer.
2. **The run's settings** (the second table; issue #37's measure: "following ``spec`` from ``tasks/train.py:
   train_local`` through the calls it is passed on to"). Followed: a call of a project function that receives the
   run's settings among its arguments (read from the frame's locals at its 'call' event: positional, keyword,
   ``*args`` and ``**kwargs``, ``self`` included), where the settings are a ``fitburst.spec.PipelineSpec``, a
   ``fitburst.settings.RunSettings`` (before issue #37: ``fitburst.runconfig.TrainSettings``) or an object whose
   own ``spec`` or ``settings`` attribute is one (the Recipe, a plan). Any instance counts, so a derived copy (a
   step-down's spec, the effective-batch spec, a one-field RunSettings built to ask the rule table) is followed
   too, and so is a method or property of the settings themselves (``spec.config_hash()``, ``settings.sharded``).
   Not followed: anything the settings were turned into (a ResolvedModel, a model, a string), and, in the
   ``settings`` rows, the spec's sections passed alone (``spec.model``, ``spec.training``); the ``+ sections`` rows
   follow those too. The path is the stack of followed calls: a call moves to its module, its return moves back
   to the module of the followed call below it. Counted: modules entered, moves between modules, moves up a layer
   (returns included, as the issue counted them) and, of those, "calls up": a followed call into a higher layer
   than the followed call that made it.

Entries: ``local``: what the flow's train task calls (``tasks/train.py`` -> ``train_local_run``), with a real MLflow
tracker (a SQLite store in a temporary folder) as the task passes it; ``node``: ``fitburst train`` in one process (the
cloud node's command: ``fitburst.cli.main``); ``task`` (the second table only): the task's own function,
``tasks/train.py:train_local``, with Prefect's run logger and progress artifact replaced by plain stand-ins (neither
receives the settings) and no preflight estimate (the estimate's record does not receive them either).

Only fitburst/, tasks/ and flows/ modules count (library frames are passed through).

    python benchmarks/call_path.py
"""

from __future__ import annotations

import functools
import inspect
import logging
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
    # rules: the rule table beside the settings (design.md); runconfig: the settings' home before issue #37
    1: ["fitburst.spec", "fitburst.spec_sections", "fitburst.settings", "fitburst.rules", "fitburst.runconfig"],
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
    return _module_of_file(code.co_filename)


@functools.cache
def _module_of_file(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
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


# the run's settings, by the class's module and name (the script runs on commits where the other classes are absent)
SETTINGS = frozenset({("fitburst.spec", "PipelineSpec"), ("fitburst.settings", "RunSettings"),
                      ("fitburst.runconfig", "TrainSettings")})
# ... or, for the second count, one of the spec's sections passed alone (spec.model, spec.training, ...): the base
# class of every pipelines.yaml section (fitburst.spec_sections.Strict; before issue #37, fitburst.spec.Strict)
SECTIONS = SETTINGS | {("fitburst.spec", "Strict"), ("fitburst.spec_sections", "Strict")}


def is_settings(obj: object, classes: frozenset) -> bool:
    return any((c.__module__, c.__qualname__) in classes for c in type(obj).__mro__)


def carries_settings(obj: object, classes: frozenset) -> bool:
    """``obj`` is the run's settings, or holds them as its own ``spec`` or ``settings`` attribute (read from its
    ``__dict__``: no property runs)."""
    if is_settings(obj, classes):
        return True
    own = getattr(obj, "__dict__", None)
    return isinstance(own, dict) and any(is_settings(own.get(name), classes) for name in ("spec", "settings"))


def receives_settings(frame, classes: frozenset) -> bool:
    """Whether the call starting in ``frame`` got the run's settings among its arguments."""
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    star = bool(code.co_flags & inspect.CO_VARARGS)
    names = code.co_varnames[:n + star + bool(code.co_flags & inspect.CO_VARKEYWORDS)]
    local = frame.f_locals
    for i, name in enumerate(names):
        value = local.get(name)
        if i < n:
            if carries_settings(value, classes):
                return True
        elif any(carries_settings(v, classes) for v in (value if i == n and star else (value or {}).values())):
            return True  # *args, **kwargs
    return False


class SettingsPath:
    """Issue #37's measure: the calls that receive the run's settings (:func:`receives_settings` with ``classes``)
    from the entry up to the first call of a family's ``train_loss``, as a stack of followed calls. Counts modules
    entered, moves between them, moves up a layer (of which calls up); tallies the moves by module pair and each
    move up by function."""

    def __init__(self, classes: frozenset = SETTINGS) -> None:
        self.classes = classes
        self.modules: list[str] = []
        self.moves = self.up = self.calls_up = 0
        self.pairs: dict[tuple[str, str], int] = {}  # (from, to) module -> moves
        self.ups: dict[str, int] = {}  # "call|return from.function -> to.function" -> moves
        self.followed: list[tuple[object, str, str]] = []  # (frame, module, function), outermost first
        self.stack: list[str] | None = None  # the followed calls at the loss
        self.entry = None
        self.done = False

    def _move(self, frm: tuple[str, str], to: tuple[str, str], how: str) -> None:
        """A move from ``frm`` to ``to`` (module, function) on a call or a return; none within a module."""
        if frm[0] == to[0]:
            return
        self.moves += 1
        self.pairs[frm[0], to[0]] = self.pairs.get((frm[0], to[0]), 0) + 1
        if layer(to[0]) > layer(frm[0]):
            self.up += 1
            self.calls_up += how == "call"
            key = f"{how:<6} L{layer(frm[0])} {'.'.join(frm)} -> L{layer(to[0])} {'.'.join(to)}"
            self.ups[key] = self.ups.get(key, 0) + 1

    def __call__(self, frame, event, arg) -> None:
        if self.done or self.entry is None or event not in ("call", "return"):
            return
        if event == "return":
            if self.followed and self.followed[-1][0] is frame:
                _, *returning = self.followed.pop()
                if self.followed:
                    self._move(tuple(returning), self.followed[-1][1:], "return")
            return
        mod = module_of(frame.f_code)
        if mod is None:
            return
        if mod.startswith("fitburst.families") and frame.f_code.co_name == "train_loss":
            self.stack = [f"{m}.{fn}" for _, m, fn in self.followed]
            self.done = True
            return
        if not receives_settings(frame, self.classes):
            return
        if mod not in self.modules:
            self.modules.append(mod)
        if self.followed:
            self._move(self.followed[-1][1:], (mod, frame.f_code.co_name), "call")
        self.followed.append((frame, mod, frame.f_code.co_name))


def profile(entry: Callable[[], object], *paths) -> None:
    """Run ``entry`` once under every profiler in ``paths`` (each sees the same calls)."""
    def started():
        for p in paths:
            p.entry = sys._getframe()
        return entry()

    sys.setprofile(lambda frame, event, arg: [p(frame, event, arg) for p in paths])
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


def task_entry(spec, prepared) -> Callable[[], object]:
    """The flow's train task's own function, outside Prefect: its run logger and progress artifact are stand-ins."""
    import tasks.train as task
    from fitburst.tracking import Tracker

    class Progress:  # tasks.progress.TrainingProgress without Prefect's artifacts: forwards each row
        def __init__(self, pipeline, total_steps, tokens_per_step, forward=None):
            self.forward = forward

        def __call__(self, row, step):
            if self.forward is not None:
                self.forward(row, step)

        def finish(self):
            pass

    task.get_run_logger = lambda: logging.getLogger("tasks.train")  # type: ignore[assignment]
    task.TrainingProgress = Progress  # type: ignore[assignment,misc]
    tracker = Tracker.start(spec)

    def entry():
        try:
            return task.train_local.fn(spec, prepared, tracker, None)
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
                            text=True).stdout.strip()[:90] or f"{ROOT}: not a git checkout"
    calls: dict[str, CallPath] = {}
    settings: dict[str, tuple[SettingsPath, SettingsPath]] = {}
    for name, make in (("local", local_entry), ("node", node_entry), ("task", task_entry)):
        settings[name] = (SettingsPath(SETTINGS), SettingsPath(SECTIONS))
        if name != "task":
            calls[name] = CallPath()
        profile(make(spec, prepared), *settings[name], *([calls[name]] if name in calls else []))

    print(f"call path from the entry to the family's train_loss, CPU demo, one step ({commit})")
    print(f"{'entry':<6} {'modules':>7} {'moves':>5} {'up':>3} {'frames':>6} {'project frames':>14}  "
          "modules on the stack at the loss")
    for name, path in calls.items():
        stack = path.stack or []
        on_stack = list(dict.fromkeys(s.rsplit(".", 1)[0] for s in stack))
        print(f"{name:<6} {len(path.modules):>7} {path.moves:>5} {path.up:>3} {path.frames:>6} {len(stack):>14}  "
              f"{len(on_stack)}")
    print("\nsettings path (issue #37's measure): the calls that receive the run's settings, entry to train_loss;"
          "\n'+ sections': also the calls that receive one of the spec's sections alone")
    print(f"{'entry':<6} {'followed':<11} {'modules':>7} {'moves':>5} {'up':>3} {'calls up':>8} "
          f"{'followed calls at the loss':>26}")
    for name in ("task", "local", "node"):
        for sp, what in zip(settings[name], ("settings", "+ sections"), strict=True):
            print(f"{name:<6} {what:<11} {len(sp.modules):>7} {sp.moves:>5} {sp.up:>3} {sp.calls_up:>8} "
                  f"{len(sp.stack or []):>26}")

    for name, path in calls.items():
        print(f"\n{name}: stack at the loss (layer, module.function)")
        for s in path.stack or []:
            print(f"  {layer(s.rsplit('.', 1)[0])}  {s}")
        print(f"{name}: modules entered: {', '.join(path.modules)}")
    for name in ("task", "local", "node"):
        sp = settings[name][0]
        print(f"\n{name}, settings path: the followed calls at the loss: {' > '.join(sp.stack or [])}")
        print(f"{name}, settings path: modules entered: {', '.join(sp.modules)}")
        print(f"{name}, settings path: moves by module pair (count, from -> to, ^ up a layer):")
        for (frm, to), n in sorted(sp.pairs.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {n:>3}  L{layer(frm)} {frm} -> L{layer(to)} {to}{'  ^' if layer(to) > layer(frm) else ''}")
        print(f"{name}, settings path: moves up (count, call or return, from -> to):")
        for move, n in sorted(sp.ups.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {n:>3}  {move}")


if __name__ == "__main__":
    main()
