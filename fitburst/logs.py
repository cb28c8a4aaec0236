"""Where log lines go: fitburst's own lines on the console, everything else in a log file.

A line is *fitburst's* when the code that logged it lives in fitburst's packages (``fitburst``, ``flows``,
``tasks``): that covers ``logging.getLogger(__name__)`` in those packages and the Prefect run logger called from
fitburst's flow and tasks, but not Prefect's engine, which logs through the same run logger. Everything else
(Prefect's engine and server, MLflow, alembic, transformers, datasets, huggingface_hub, bitsandbytes, SkyPilot,
Python warnings) goes to the log file only, unless ``-v`` puts it on the console too.

A :class:`~fitburst.errors.UserError` is never shown with a traceback: the filter on Prefect's run loggers drops
the traceback from the engine's failure records in every handler (console, log file, Prefect's API and UI), and
the CLI prints the message once itself.

Call :func:`setup` before Prefect, MLflow or transformers are imported: Prefect keeps a root handler it finds
(``setup_logging`` drops its own root config then), MLflow reads ``MLFLOW_CONFIGURE_LOGGING`` at import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("fitburst", "flows", "tasks")
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
# settings a user may have set; only defaults are applied (os.environ.setdefault)
QUIET_ENV = {
    "MLFLOW_CONFIGURE_LOGGING": "false",  # MLflow's loggers propagate to ours instead of printing themselves
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # hub, transformers' weight loading
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}


def _package_dirs() -> tuple[str, ...]:
    """The folders of fitburst's packages, found without importing them."""
    dirs: list[str] = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.realpath(p) + os.sep for p in spec.submodule_search_locations)
    return tuple(dirs)


class FitburstOnly(logging.Filter):
    """Passes a record only when the code that logged it lives in one of fitburst's packages."""

    def __init__(self) -> None:
        super().__init__()
        self.dirs = _package_dirs()

    def filter(self, record: logging.LogRecord) -> bool:
        return os.path.realpath(record.pathname).startswith(self.dirs)


class UserErrorWithoutTraceback(logging.Filter):
    """Drops the traceback of a record about a UserError (its message says what to fix; the stack adds nothing)
    and keeps the record's one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        from fitburst.errors import UserError

        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info = None
            record.exc_text = None
        return True


class StderrHandler(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is when a record is written (a test's capture, a redirect).
    Prefect keeps a root handler like this one (its class name has no leading underscore) instead of its own."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class ConsoleFormatter(logging.Formatter):
    """``fitburst: message`` (``fitburst: warning: message`` above INFO); continuation lines indented."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        level = "" if record.levelno <= logging.INFO else f"{record.levelname.lower()}: "
        return f"fitburst: {level}" + text.replace("\n", "\n  ")


def log_dir(base: Path | None = None) -> Path:
    """``$FITBURST_LOG_DIR``, else ``logs/`` beside the run folders: ``$FITBURST_RUNS_DIR/../logs``, or
    ``<base>/logs`` (the pipelines file's folder, which holds ``runs/``), or ``./logs``."""
    if os.environ.get("FITBURST_LOG_DIR"):
        return Path(os.environ["FITBURST_LOG_DIR"])
    if os.environ.get("FITBURST_RUNS_DIR"):
        return Path(os.environ["FITBURST_RUNS_DIR"]).parent / "logs"
    return (base or Path(".")) / "logs"


def quiet_user_errors() -> None:
    """Install the UserError filter on Prefect's run loggers (idempotent); the flow module calls it too, so a
    deployment run served by any process logs no traceback for a user's mistake."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, UserErrorWithoutTraceback) for f in logger.filters):
            logger.addFilter(UserErrorWithoutTraceback())


def _adopt(name: str) -> None:
    """Make a library logger that prints through its own console handler send its records to ours instead."""
    logger = logging.getLogger(name)
    for h in list(logger.handlers):
        if type(h) is logging.StreamHandler:
            logger.removeHandler(h)
    logger.propagate = True


@contextlib.contextmanager
def routed(name: str) -> Iterator[None]:
    """For a block: the records of a library logger that prints through console handlers of its own (SkyPilot's
    ``sky``) go to ours instead (the log file; the console with ``-v``); its handlers are put back after."""
    logger = logging.getLogger(name)
    own = [h for h in logger.handlers
           if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    propagate = logger.propagate
    for h in own:
        logger.removeHandler(h)
    logger.propagate = True
    try:
        yield
    finally:
        for h in own:
            logger.addHandler(h)
        logger.propagate = propagate


def route_libraries(transformers: bool = False) -> None:
    """huggingface_hub (and, with ``transformers``, transformers: an import of about a second, which the commands
    that load a model pay anyway) print through handlers of their own at import; hand their records to ours."""
    import huggingface_hub.utils.logging  # noqa: F401  (its import adds the handler _adopt removes)

    _adopt("huggingface_hub")
    if transformers:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()


def _file_handler(path: Path) -> logging.FileHandler | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return logging.FileHandler(path, encoding="utf-8")  # opened here: an unwritable folder fails now
    except OSError:  # no writable log folder: the console alone
        return None


def quiet_libraries() -> None:
    """Set :data:`QUIET_ENV` where the user has not: before the libraries are imported, which read it then."""
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)


def setup(command: str, verbose: bool = False, base: Path | None = None) -> Path | None:
    """Configure logging for one CLI command; returns the log file (None if it cannot be written)."""
    quiet_libraries()
    root = logging.getLogger()
    for h in list(root.handlers):  # a second setup in one process (tests) replaces the first one's handlers
        if getattr(h, "fitburst", False):
            root.removeHandler(h)
            h.close()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    console = StderrHandler()
    if verbose:
        console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    else:
        console.setFormatter(ConsoleFormatter("%(message)s"))
        console.addFilter(FitburstOnly())
    console.fitburst = True  # type: ignore[attr-defined]
    root.addHandler(console)
    path = log_dir(base) / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}-{os.getpid()}.log"
    file = _file_handler(path)
    if file is not None:
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        file.fitburst = True  # type: ignore[attr-defined]
        root.addHandler(file)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock", "aiosqlite", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(True)
    quiet_user_errors()
    return path if file is not None else None
