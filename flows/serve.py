"""`fitburst serve`: every pipeline in pipelines.yaml becomes a Prefect deployment of the finetune flow.

    fitburst serve [--file pipelines.yaml]                  serve here (this process runs the flow runs)
    python -m flows.serve [--file F]                       the same
    python -m flows.serve --write-prefect-yaml [prefect.yaml]   the production path: `prefect deploy --all` + a
                                                            process worker (`prefect worker start --pool fitburst`)
    python -m flows.serve --setup-only                     after `prefect deploy`: the concurrency limit, stale
                                                            deployments and the notifications, no serving

On start the file is validated (a broken file is refused, with located errors), then for each pipeline: a deployment
``finetune/<pipeline>`` with the pipeline's cron + timezone (no schedule without a cron), its tags, and default
parameters (the pipeline name, fixed; the absolute path of the file). The ``overrides`` parameter carries a JSON
schema derived from PipelineSpec (flows.finetune.overrides_schema), so the Prefect server refuses a bad override
before a run exists. Deployments of the finetune flow whose pipeline is gone from the file are deleted, so a changed
pipelines.yaml takes effect on restart.

Local GPU contention: a tag concurrency limit of 1 on ``fitburst-local-train`` (the local train task's tag) means two
local trainings never share the machine; the cloud task has no such tag, so bursts run in parallel.

Notifications (``notify:`` in a pipeline): one Prefect notification block per target (a JSON webhook, Slack, Discord,
SendGrid e-mail; the URL or key resolved from its ${ENV} reference here and stored as a secret in the block, never
logged) and one automation per event: ``failed`` (flow run Failed/Crashed: the reason), ``completed`` (the
fitburst.run.completed event with the headline metrics), ``burst`` (fitburst.run.bursted, with the cost).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from fitburst.spec import DEFAULT_PIPELINES_FILE, NotifySpec, PipelineSpec, SpecError, load_all, resolve_env
from tasks import artifact_key

FLOW_NAME = "finetune"
WORK_POOL = "fitburst"
ENTRYPOINT = "flows/finetune.py:finetune"
LOCAL_TRAIN_LIMIT = 1
AUTOMATION_PREFIX = "fitburst/"

log = logging.getLogger("fitburst.serve")

EXPECT = {
    "failed": {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
    "completed": {"fitburst.run.completed"},
    "burst": {"fitburst.run.bursted"},
}
SUBJECT = {
    "failed": "fitburst: {name} failed",
    "completed": "fitburst: {name} completed",
    "burst": "fitburst: {name} trained on a rented GPU",
}
# Jinja, rendered by the Prefect server's automation actions (flow_run / event come from the triggering event).
_LINK = "{{% if flow_run|ui_url %}}\n{{{{ flow_run|ui_url }}}}{{% endif %}}"
BODY = {
    "failed": ("Pipeline {name}: flow run {{{{ flow_run.name }}}} ({{{{ flow_run.id }}}}) ended "
               "{{{{ flow_run.state.name }}}}.\nReason: {{{{ flow_run.state.message }}}}" + _LINK),
    "completed": "{{{{ event.payload.text }}}}\nFlow run {{{{ flow_run.name }}}}" + _LINK,
    "burst": ("Pipeline {name} bursted: cost ${{{{ event.payload.cost_usd }}}}.\n{{{{ event.payload.text }}}}"
              + _LINK),
}


def deployment_tags(spec: PipelineSpec) -> list[str]:
    return ["fitburst", f"pipeline:{spec.name}"] + [f"{k}:{v}" for k, v in spec.tags.items()]


# --- deployments ------------------------------------------------------------------------------------------

def build_deployments(pipelines_file: str | os.PathLike, specs: dict[str, PipelineSpec]) -> list:
    """One RunnerDeployment of the finetune flow per pipeline (not yet registered)."""
    from prefect.deployments.runner import EntrypointType, freeze  # prefect: heavy, kept off `fitburst serve -h`
    from prefect.schedules import Cron

    from flows.finetune import finetune  # imports prefect: heavy, kept off `fitburst serve -h`

    path = str(Path(pipelines_file).resolve())
    out = []
    for name, spec in specs.items():
        sched = [Cron(spec.schedule.cron, timezone=spec.schedule.timezone)] if spec.schedule.cron else []
        out.append(finetune.to_deployment(
            name=name,
            schedules=sched,
            paused=False,
            tags=deployment_tags(spec),
            description=spec.description or f"fitburst pipeline {name}",
            parameters={"pipeline": freeze(name), "pipelines_file": path},
            enforce_parameter_schema=True,
            entrypoint_type=EntrypointType.MODULE_PATH,  # runs from any working directory
        ))
    return out


async def delete_stale(client, keep: set[str]) -> list[str]:
    """Delete deployments of the finetune flow whose pipeline is no longer in the file."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName  # prefect: heavy

    gone = []
    for d in await client.read_deployments(flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME]))):
        if d.name not in keep:
            await client.delete_deployment(d.id)
            gone.append(d.name)
    return gone


async def ensure_local_train_limit(client) -> None:
    """Tag concurrency limit: at most one local training at a time (an upsert, so safe on every start)."""
    from tasks.train import LOCAL_TRAIN_TAG  # imports prefect: heavy, kept off `fitburst serve -h`

    await client.create_concurrency_limit(tag=LOCAL_TRAIN_TAG, concurrency_limit=LOCAL_TRAIN_LIMIT)


# --- notifications ----------------------------------------------------------------------------------------

def _block(kind: str, value: str, notify: NotifySpec, pipeline: str):
    from prefect.blocks import notifications as nb  # prefect: heavy, kept off `fitburst serve -h`
    from prefect.types import SecretDict
    from pydantic import SecretStr

    # the blocks' secret fields typed as such (pydantic would wrap the plain strings the same way)
    if kind == "webhook_url":
        return nb.CustomWebhookNotificationBlock(
            name=f"fitburst {pipeline}", url="{{url}}", method="POST", headers=None, cookies=None,
            json_data={"subject": "{{subject}}", "text": "{{body}}", "pipeline": pipeline},
            secrets=SecretDict({"url": value}))
    if kind == "slack_webhook_url":
        return nb.SlackWebhook(url=SecretStr(value))
    if kind == "discord_webhook_url":
        parts = value.rstrip("/").split("/")
        if len(parts) < 2 or "webhooks" not in parts:
            raise ValueError("not a Discord webhook URL (https://discord.com/api/webhooks/<id>/<token>)")
        return nb.DiscordWebhook(webhook_id=SecretStr(parts[-2]), webhook_token=SecretStr(parts[-1]))
    if kind == "email":
        assert notify.email is not None
        return nb.SendgridEmail(api_key=SecretStr(value), sender_email=notify.email.sender, to_emails=notify.email.to)
    raise ValueError(kind)


async def apply_notifications(client, specs: dict[str, PipelineSpec], ids: dict[str, Any]) -> dict[str, list[str]]:
    """Replace every fitburst automation with the ones pipelines.yaml asks for; returns pipeline -> automation names.
    Secrets are resolved here, written only into the blocks (as secret fields) and never logged."""
    from prefect.events.actions import ActionTypesOrUnknown, SendNotification  # prefect: heavy, off `serve -h`
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    for a in await client.read_automations():
        if a.name.startswith(AUTOMATION_PREFIX):
            await client.delete_automation(a.id)
    made: dict[str, list[str]] = {}
    for name, spec in specs.items():
        n = spec.notify
        if not n.targets() or name not in ids:
            continue
        blocks = []
        for kind, ref in n.targets().items():
            value = resolve_env(ref)
            if not value:
                log.warning("%s: notify target %s is %s, which is not set in this environment; skipped",
                            name, kind, ref)
                continue
            if kind != "email" and not value.startswith(("http://", "https://")):
                log.warning("%s: %s (from %s) is not an http(s) URL; skipped", name, kind, ref)
                continue
            try:
                block = _block(kind, value, n, name)
            except ValueError as e:
                log.warning("%s: %s (from %s): %s; skipped", name, kind, ref, e)
                continue
            blocks.append(await block.asave(f"fitburst-{artifact_key(name)}-{kind.replace('_', '-')}", overwrite=True))
        if not blocks:
            continue
        for event in n.events:
            trigger = EventTrigger(
                expect=EXPECT[event], match_related={"prefect.resource.id": f"prefect.deployment.{ids[name]}"},
                posture=Posture.Reactive, threshold=1, within=timedelta(0))
            actions: list[ActionTypesOrUnknown] = [
                SendNotification(block_document_id=b, subject=SUBJECT[event].format(name=name),
                                 body=BODY[event].format(name=name)) for b in blocks]
            auto = f"{AUTOMATION_PREFIX}{name}/{event}"
            await client.create_automation(AutomationCore(
                name=auto, description=f"fitburst serve: notify on {event} of finetune/{name}", trigger=trigger,
                actions=actions, tags=["fitburst"]))
            made.setdefault(name, []).append(auto)
    return made


# --- serving ----------------------------------------------------------------------------------------------

async def setup(specs: dict[str, PipelineSpec], ids: dict[str, Any]) -> None:
    """What serve and the worker path share: stale deployments out, the local-train limit, notifications."""
    from prefect.client.orchestration import get_client  # prefect: heavy, kept off `fitburst serve -h`

    from tasks.train import LOCAL_TRAIN_TAG  # imports prefect: heavy, kept off `fitburst serve -h`

    async with get_client() as client:
        gone = await delete_stale(client, set(specs))
        if gone:
            log.info("deleted deployments of pipelines no longer in the file: %s", ", ".join(gone))
        await ensure_local_train_limit(client)
        log.info("concurrency limit: tag %s, %d at a time", LOCAL_TRAIN_TAG, LOCAL_TRAIN_LIMIT)
        for name, autos in (await apply_notifications(client, specs, ids)).items():
            log.info("%s: notifications %s", name, ", ".join(a.rsplit("/", 1)[-1] for a in autos))


async def _deployment_ids(specs: dict[str, PipelineSpec]) -> dict[str, Any]:
    from prefect.client.orchestration import get_client  # prefect: heavy, kept off `fitburst serve -h`
    from prefect.exceptions import ObjectNotFound

    ids = {}
    async with get_client() as client:
        for name in specs:
            try:
                ids[name] = (await client.read_deployment_by_name(f"{FLOW_NAME}/{name}")).id
            except ObjectNotFound:
                log.warning("no deployment %s/%s yet (run `prefect deploy --all` first)", FLOW_NAME, name)
    return ids


async def _serve(specs: dict[str, PipelineSpec], deployments: list) -> None:
    from prefect.runner import Runner  # prefect: heavy, kept off `fitburst serve -h`

    runner = Runner(name="fitburst", pause_on_shutdown=True)
    ids = {d.name: await runner.aadd_deployment(d) for d in deployments}
    await setup(specs, ids)
    for name, spec in specs.items():
        when = f"cron '{spec.schedule.cron}' {spec.schedule.timezone}" if spec.schedule.cron else "no schedule"
        log.info("serving %s/%s (%s)", FLOW_NAME, name, when)
    log.info("ready: prefect deployment run '%s/<pipeline>' --param overrides='{...}' --watch", FLOW_NAME)
    await runner.start()


def load(pipelines_file: str | os.PathLike) -> dict[str, PipelineSpec]:
    """Validate the whole file first: a broken file is refused (SpecError with located problems)."""
    return load_all(pipelines_file)


def main(pipelines_file: str | os.PathLike | None = None, setup_only: bool = False) -> int:
    from prefect.exceptions import TerminationSignal  # prefect: heavy, kept off `fitburst serve -h`

    pipelines_file = pipelines_file or DEFAULT_PIPELINES_FILE
    specs = load(pipelines_file)
    if setup_only:
        asyncio.run(_setup_only(specs))
        return 0
    deployments = build_deployments(pipelines_file, specs)
    try:
        asyncio.run(_serve(specs, deployments))
    except (KeyboardInterrupt, TerminationSignal) as e:
        log.info("%s: stopped serving", type(e).__name__)
    return 0


async def _setup_only(specs: dict[str, PipelineSpec]) -> None:
    await setup(specs, await _deployment_ids(specs))


# --- production path: prefect.yaml ------------------------------------------------------------------------

def prefect_yaml(pipelines_file: str | os.PathLike, specs: dict[str, PipelineSpec], root: Path) -> dict:
    """prefect.yaml for `prefect deploy --all` from ``root`` (the repository): the same deployments as serve, on
    the process work pool ``fitburst``."""
    import prefect

    rel = os.path.relpath(Path(pipelines_file).resolve(), root.resolve())
    deployments = []
    for name, spec in specs.items():
        d: dict[str, Any] = {
            "name": name,
            "description": spec.description or f"fitburst pipeline {name}",
            "entrypoint": ENTRYPOINT,
            "tags": deployment_tags(spec),
            "parameters": {"pipeline": name, "pipelines_file": rel},
            "enforce_parameter_schema": True,
            "work_pool": {"name": WORK_POOL, "work_queue_name": "default", "job_variables": {}},
            "schedules": ([{"cron": spec.schedule.cron, "timezone": spec.schedule.timezone, "active": True}]
                          if spec.schedule.cron else []),
        }
        deployments.append(d)
    return {"name": "fitburst", "prefect-version": prefect.__version__, "build": None, "push": None,
            "deployments": deployments}


HEADER = """\
# Generated from {src} by `python -m flows.serve --write-prefect-yaml`; edit pipelines.yaml, then regenerate
# (tests/test_serve.py checks the two agree). The production path, from the repository root on the GPU box:
#   prefect work-pool create fitburst --type process
#   prefect deploy --all
#   python -m flows.serve --setup-only     # local-train concurrency limit, notifications, stale deployments
#   prefect worker start --pool fitburst
# No pull step: `prefect deploy` records the directory it runs in as the flow's working directory.
"""


def write_prefect_yaml(pipelines_file: str | os.PathLike, out: str | os.PathLike = "prefect.yaml") -> Path:
    import yaml

    specs = load(pipelines_file)
    out = Path(out)
    doc = prefect_yaml(pipelines_file, specs, out.resolve().parent)
    src = os.path.relpath(Path(pipelines_file).resolve(), out.resolve().parent)
    out.write_text(HEADER.format(src=src) + yaml.safe_dump(doc, sort_keys=False, width=120))
    return out


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", "-f", default=DEFAULT_PIPELINES_FILE)
    p.add_argument("--write-prefect-yaml", nargs="?", const="prefect.yaml", metavar="OUT",
                   help="write prefect.yaml for `prefect deploy --all` and exit")
    p.add_argument("--setup-only", action="store_true",
                   help="concurrency limit, notifications and stale-deployment cleanup for deployed pipelines; exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.write_prefect_yaml:
            print(f"wrote {write_prefect_yaml(args.file, args.write_prefect_yaml)}")
            return 0
        return main(args.file, setup_only=args.setup_only)
    except SpecError as e:
        print(f"error: refusing to serve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
