"""GPU offers for the burst path: price and memory per provider (throughput: :mod:`fitburst.hours`; GPU names and
who sells each: :data:`fitburst.hardware.SKY_NAMES`).

Prices, device memory and which provider offers what come from SkyPilot's own catalog (:func:`offers`); only when
that catalog cannot be read (no network and nothing cached) does :data:`SNAPSHOT` stand in; every offer says which
source it came from.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import asdict, dataclass

from fitburst.cache import cache_root, keep, read_kept
from fitburst.hardware import SKY_CLOUD, SKY_NAMES, canonical_gpu

log = logging.getLogger(__name__)

# Fallback only: public on-demand list prices (USD/h, one GPU) noted 2026-11 for the cheapest 1-GPU instance.
# Spot prices are None where the provider has no spot market (Lambda).
SNAPSHOT_DATE = "2026-11"
SNAPSHOT: dict[tuple[str, str], tuple[float, float | None, float]] = {
    # (gpu, provider): (on-demand $/h, spot $/h, device memory GiB)
    ("A6000", "runpod"): (0.49, 0.25, 48.0),
    ("A6000", "lambda"): (0.80, None, 48.0),
    ("L4", "runpod"): (0.43, 0.22, 24.0),
    ("A100-80GB", "runpod"): (1.64, 0.82, 80.0),
    ("A100-80GB", "lambda"): (1.79, None, 80.0),
    ("A100-40GB", "lambda"): (1.29, None, 40.0),
    ("H100", "runpod"): (2.39, 1.25, 80.0),
    ("H100", "lambda"): (2.49, None, 80.0),
    ("T4", "aws"): (0.526, 0.21, 16.0),
    ("T4", "gcp"): (0.54, 0.16, 16.0),
    ("T4", "azure"): (0.526, 0.0526, 16.0),
    ("L4", "aws"): (0.805, 0.32, 24.0),
    ("L4", "gcp"): (0.71, 0.28, 24.0),
    ("A10G", "aws"): (1.006, 0.40, 24.0),
}


@dataclass
class Offer:
    """One provider's cheapest instance with ``count`` GPUs of a fitburst GPU name."""

    gpu: str  # fitburst name
    provider: str  # runpod | lambda | aws | gcp | azure
    accelerator: str  # SkyPilot catalog name on that provider
    memory_gib: float | None  # one GPU's memory
    hourly_usd: float | None  # the instance, on-demand or spot, as asked
    region: str | None
    instance_type: str | None
    source: str  # "skypilot-catalog" | "fitburst-snapshot-<date>"
    count: int = 1  # GPUs on the instance
    host_memory_gib: float | None = None  # the instance's RAM, where the catalog says

    def to_dict(self) -> dict:
        return asdict(self)


def _catalog_offers(gpu: str, provider: str, spot: bool, count: int = 1) -> list[Offer]:
    """Ask SkyPilot's catalog for instances with ``count`` of ``gpu`` (may raise when it cannot be fetched)."""
    from sky import catalog, sky_logging  # heavy; only on the burst path

    from fitburst.logs import routed

    acc = SKY_NAMES[gpu][provider]
    # no status lines; its fetch messages to fitburst's log file: the caller says what a failure means
    with sky_logging.silent(), routed("sky"):
        found = catalog.list_accelerators(
            gpus_only=True,
            name_filter=f"^{re.escape(acc)}$",
            quantity_filter=count,
            clouds=SKY_CLOUD[provider],
            case_sensitive=False,
            all_regions=True,
        )
    out = []
    for name, infos in found.items():
        if name.upper() != acc.upper():
            continue
        for info in infos:
            if int(info.accelerator_count) != count:
                continue
            price = info.spot_price if spot else info.price
            if price is None or price != price:  # NaN: not offered that way
                continue
            out.append(
                Offer(
                    gpu,
                    provider,
                    name,
                    info.device_memory / count if info.device_memory else None,
                    float(price),
                    info.region,
                    info.instance_type,
                    "skypilot-catalog",
                    count,
                    info.memory,
                )
            )
    return out


class CatalogUnavailable(Exception):
    """SkyPilot's catalog of a provider could not be read (the cause's type name in the message)."""


def offers_ttl() -> float:
    """Seconds a catalog answer is kept (``FITBURST_OFFERS_TTL``, default an hour: SkyPilot itself refreshes its
    catalog every 7 hours, and importing SkyPilot to ask it costs a preflight about 2 s)."""
    return float(os.environ.get("FITBURST_OFFERS_TTL", 3600))


def _kept_catalog_offers(gpu: str, provider: str, spot: bool, count: int = 1) -> list[Offer]:
    """:func:`_catalog_offers`, or its answer of the last :func:`offers_ttl` seconds (an unreadable catalog too:
    raised again as CatalogUnavailable)."""
    path = cache_root() / "offers" / f"{provider}-{gpu}x{count}-{'spot' if spot else 'on-demand'}.json"
    ttl = offers_ttl()
    kept = read_kept(path, ttl)
    if kept is not None and "unavailable" in kept:
        raise CatalogUnavailable(kept["unavailable"])
    try:
        if kept is not None:
            return [Offer(**o) for o in kept["offers"]]
    except (KeyError, TypeError):  # a file of another shape: ask the catalog
        pass
    try:
        found = _catalog_offers(gpu, provider, spot, count)
        kept = {"offers": [o.to_dict() for o in found]}
    except Exception as e:  # noqa: BLE001 - network errors, missing catalog, pandas errors
        found, kept = [], {"unavailable": type(e).__name__}
    if ttl > 0:
        keep(path, kept)
    if "unavailable" in kept:
        raise CatalogUnavailable(kept["unavailable"])
    return found


_WARNED: set[str] = set()  # providers whose unreadable catalog was reported


def offers(
    gpus: list[str], providers: list[str], spot: bool = False, use_catalog: bool = True, count: int = 1
) -> list[Offer]:
    """The cheapest offer per (gpu, provider) among ``providers`` for each GPU, cheapest first within a GPU, of
    instances with ``count`` GPUs.

    SkyPilot's catalog is the source (its answer kept for :func:`offers_ttl`); a provider whose catalog cannot be
    read falls back to :data:`SNAPSHOT` (the offer's ``source`` says so; several GPUs priced as ``count`` times
    one). Combinations the provider does not
    sell are left out.
    """
    result: list[Offer] = []
    catalog_ok: dict[str, bool] = {}
    for raw in gpus:
        gpu = canonical_gpu(raw)
        for provider in providers:
            if provider not in SKY_NAMES[gpu]:
                continue
            found: list[Offer] = []
            if use_catalog and catalog_ok.get(provider, True):
                try:
                    found = _kept_catalog_offers(gpu, provider, spot, count)
                    catalog_ok[provider] = True
                except CatalogUnavailable as e:
                    if provider not in _WARNED:  # once per process: each GPU count asks again
                        _WARNED.add(provider)
                        log.warning(
                            "SkyPilot catalog for %s unavailable (%s); using fitburst's %s price snapshot",
                            provider,
                            e,
                            SNAPSHOT_DATE,
                        )
                    catalog_ok[provider] = False
            if not catalog_ok.get(provider, False) or not use_catalog:
                snap = SNAPSHOT.get((gpu, provider))
                if snap is not None:
                    price = snap[1] if spot else snap[0]
                    if price is not None:
                        found = [
                            Offer(
                                gpu,
                                provider,
                                SKY_NAMES[gpu][provider],
                                snap[2],
                                price * count,
                                None,
                                None,
                                f"fitburst-snapshot-{SNAPSHOT_DATE}" + (f" x {count}" if count > 1 else ""),
                                count,
                            )
                        ]
            if found:
                result.append(min(found, key=lambda o: o.hourly_usd or float("inf")))
    return result
