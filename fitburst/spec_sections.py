"""pipelines.yaml's sections beside the run itself: where a run may burst (``burst``), when it runs (``schedule``),
who hears about it (``notify``) and where it is recorded (``tracking``); and what every section shares: strict
models (an unknown key is an error) and ``${ENV_VAR}`` references for secrets. :class:`fitburst.spec.PipelineSpec`
holds them."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fitburst.hardware import SKY_NAMES, gpu_entry

ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


Provider = Literal["runpod", "lambda", "aws", "gcp", "azure"]
_DEFAULT_PROVIDERS: tuple[Provider, ...] = ("runpod", "lambda")


class BurstSpec(Strict):
    """When and where to rent GPUs (fitburst.cloud). GPU names as the memory estimator spells them."""

    policy: Literal["auto", "never", "always"] = "auto"
    gpus: list[str] = Field(default_factory=lambda: ["A6000", "T4"],
                            description="T4, L4, A10G, A6000, A100-40GB, A100-80GB, H100 (RTXA6000 = A6000); "
                                        "NAME:N fixes N GPUs per node (A6000:2, H100:8), a bare name lets the "
                                        "planner pick how many")
    max_gpus_per_node: int = Field(default=8, ge=1, le=16, description="most GPUs one rented node may have")
    max_nodes: int = Field(default=1, ge=1, le=64, description="most nodes one run may span (more than 1: "
                                                              "multi-node FSDP over SkyPilot's num_nodes)")
    providers: list[Provider] = Field(default_factory=lambda: list(_DEFAULT_PROVIDERS))
    spot: bool = False
    max_hourly_usd: float | None = Field(default=None, gt=0)
    max_total_usd: float | None = Field(default=None, gt=0)
    max_local_hours: float | None = Field(default=None, gt=0)
    max_monthly_usd: float | None = Field(default=None, gt=0, description="this pipeline's rented-GPU spend in a "
                                          "calendar month (UTC), read from MLflow: a burst whose estimate would go "
                                          "over it is refused before launch")
    max_monthly_usd_all: float | None = Field(default=None, gt=0, description="the same cap over every pipeline "
                                              "of the tracking experiment together (set it under defaults: one "
                                              "budget for the whole file)")
    autostop_minutes: int = Field(default=30, ge=1)
    bucket: str | None = Field(
        default=None, description="s3:// or gs:// bucket for a spot (managed) job's outputs and checkpoints"
    )

    @field_validator("gpus")
    @classmethod
    def _known_gpus(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("list at least one GPU, e.g. [A6000, T4]")
        entries = [gpu_entry(g) for g in v]
        return list(dict.fromkeys(g if n is None else f"{g}:{n}" for g, n in entries))

    def gpu_choices(self) -> list[tuple[str, int | None]]:
        """(GPU, GPUs per node or None: the planner picks) for each ``gpus`` entry."""
        return [gpu_entry(g) for g in self.gpus]

    def gpu_names(self) -> list[str]:
        return list(dict.fromkeys(g for g, _ in self.gpu_choices()))

    @field_validator("providers")
    @classmethod
    def _some_providers(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("list at least one provider, e.g. [runpod, lambda]")
        return list(dict.fromkeys(v))

    @field_validator("bucket")
    @classmethod
    def _bucket_url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(s3|gs|r2|az|cos|oci)://[^/\s]+", v):
            raise ValueError("bucket must be a URL such as s3://my-bucket/fitburst or gs://my-bucket")
        return v

    @model_validator(mode="after")
    def _spot_needs_provider(self) -> BurstSpec:
        if self.spot and self.providers == ["lambda"]:
            raise ValueError("Lambda has no spot instances: set spot: false or add another provider")
        if self.spot and self.bucket is None:
            raise ValueError("a spot node can be reclaimed mid-run and its disk goes with it: set burst.bucket "
                             "(s3://... or gs://...) so checkpoints survive and the restart resumes, or spot: false")
        over = [g for g, n in self.gpu_choices() if n is not None and n > self.max_gpus_per_node]
        if over:
            raise ValueError(f"{', '.join(f'{g}:{n}' for g, n in self.gpu_choices() if g in over)} asks for more "
                             f"GPUs per node than max_gpus_per_node ({self.max_gpus_per_node}): lower the count, or "
                             "raise burst.max_gpus_per_node")
        names = self.gpu_names()
        if not any(p in SKY_NAMES[g] for g in names for p in self.providers):
            sellers = {g: ", ".join(SKY_NAMES[g]) for g in names}
            raise ValueError(
                f"none of {names} is offered by {', '.join(self.providers)} "
                f"({'; '.join(f'{g} is on {s}' for g, s in sellers.items())})"
            )
        if self.max_total_usd is not None and self.max_hourly_usd is not None and (
                self.max_total_usd < self.max_hourly_usd * 0.25):
            raise ValueError("max_total_usd buys less than 15 minutes at max_hourly_usd: no run could start")
        return self


CRON_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day-of-month", 1, 31), ("month", 1, 12), ("weekday", 0, 7))
_CRON_NAMES = {n: i for i, n in enumerate(
    ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], 1)} | {
    n: i for i, n in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
_CRON_PART = re.compile(r"^(\*|([a-z0-9]+)(?:-([a-z0-9]+))?)(?:/([0-9]+))?$")


def _cron_field_ok(text: str, lo: int, hi: int) -> bool:
    """One cron field (``*``, ``5``, ``1-5``, ``*/15``, ``mon-fri``, lists of these) lies within lo..hi.
    (Prefect, which runs the schedule, vendors croniter; fitburst itself does not import Prefect.)"""
    for part in text.split(","):
        m = _CRON_PART.match(part)
        if not m or m.group(4) == "0":
            return False
        for bound in (m.group(2), m.group(3)):
            if bound is not None:
                n = _CRON_NAMES.get(bound, int(bound) if bound.isdigit() else -1)
                if not lo <= n <= hi:
                    return False
    return True


class ScheduleSpec(Strict):
    cron: str | None = None
    timezone: str = "UTC"
    when: Literal["changed", "always"] | None = Field(
        default=None, description="changed: train only when the data, the settings, the base model or the training "
        "code changed since the pipeline's last completed run; always: train every time. Unset: changed for a run "
        "the schedule starts, always for a run a person starts")

    @field_validator("cron")
    @classmethod
    def _cron_shape(cls, v: str | None) -> str | None:
        if v is not None:
            if len(v.split()) != 5:
                raise ValueError("cron needs five fields (minute hour day month weekday), e.g. '0 2 * * *'")
            for text, (what, lo, hi) in zip(v.split(), CRON_FIELDS, strict=True):
                if not _cron_field_ok(text.lower(), lo, hi):
                    raise ValueError(f"cron {what} field {text!r} is not a value, range, list or step in {lo}-{hi} "
                                     "(e.g. '0 2 * * *' is 02:00 every day)")
        return v

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, v: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown timezone {v!r}: use an IANA name such as 'Europe/Berlin'") from None
        return v


NotifyEvent = Literal["failed", "completed", "burst"]
_DEFAULT_EVENTS: tuple[NotifyEvent, ...] = ("failed",)
NOTIFY_SECRETS = ("webhook_url", "slack_webhook_url", "discord_webhook_url")


class EmailSpec(Strict):
    """E-mail through SendGrid (Prefect's SendgridEmail block)."""

    to: list[str] = Field(min_length=1, description="recipient addresses")
    sender: str = Field(default="fitburst@localhost", description="the From address (verified in SendGrid)")
    sendgrid_api_key: str = Field(description="a ${ENV_VAR} reference to the SendGrid API key")

    @field_validator("to")
    @classmethod
    def _addresses(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if not re.match(r"^[^@\s]+@[^@\s]+\.[^@\s]+$", a)]
        if bad:
            raise ValueError(f"not an e-mail address: {', '.join(bad)}")
        return v


class NotifySpec(Strict):
    """Who hears about a served run's outcome (Prefect notification blocks + automations, made by `fitburst serve`).

    Every target is a ``${ENV_VAR}`` reference: webhook URLs carry their secret in the URL. ``events`` (not ``on``:
    YAML reads a bare ``on`` as true): failed (failure with the reason), completed (the headline metrics), burst
    (a run trained on a rented GPU, with its cost).
    """

    events: list[NotifyEvent] = Field(default_factory=lambda: list(_DEFAULT_EVENTS))
    webhook_url: str | None = Field(default=None, description="${ENV_VAR}: any URL that takes a JSON POST")
    slack_webhook_url: str | None = Field(default=None, description="${ENV_VAR}: a Slack incoming-webhook URL")
    discord_webhook_url: str | None = Field(default=None, description="${ENV_VAR}: a Discord webhook URL")
    email: EmailSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _secrets_are_references(cls, data: Any) -> Any:
        # checked on the raw mapping so that a pasted literal URL is never echoed back in the error message
        if isinstance(data, dict):
            for key in NOTIFY_SECRETS:
                v = data.get(key)
                if v is not None and not (isinstance(v, str) and ENV_REF.match(v)):
                    raise ValueError(f"notify.{key} must be an environment reference such as ${{SLACK_WEBHOOK_URL}} "
                                     "(webhook URLs are secrets; the value given is not shown)")
            email = data.get("email")
            if isinstance(email, dict) and "sendgrid_api_key" in email and not (
                    isinstance(email["sendgrid_api_key"], str) and ENV_REF.match(email["sendgrid_api_key"])):
                raise ValueError("notify.email.sendgrid_api_key must be an environment reference such as "
                                 "${SENDGRID_API_KEY} (the value given is not shown)")
        return data

    @field_validator("events")
    @classmethod
    def _unique_events(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    def targets(self) -> dict[str, str]:
        """kind -> ${ENV} reference of each configured target (email: the API key)."""
        out = {k: getattr(self, k) for k in NOTIFY_SECRETS if getattr(self, k)}
        if self.email is not None:
            out["email"] = self.email.sendgrid_api_key
        return out


class TrackingSpec(Strict):
    uri: str | None = Field(default=None, description="MLflow tracking URI; MLFLOW_TRACKING_URI wins when set")
    experiment: str = "fitburst"
    log_model: bool = Field(default=True, description="log the tuned model as an MLflow model (transformers "
                            "flavor; a LoRA adapter references its base model instead of copying it)")
    register_as: str | None = Field(default=None, description="register each run's model under this name in the "
                                    "MLflow Model Registry; alias 'champion' follows the best eval loss")
    push_to_hub: str | None = Field(default=None, description="Hugging Face repo id (org/name) to push the adapter "
                                    "and a generated model card to after the run; needs HF_TOKEN")
