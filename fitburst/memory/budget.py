"""Whether an estimate fits: the one rule, used by the planner, the preflight and `fitburst estimate`.

A run fits ``device`` when the upper edge of its estimate's error band (:mod:`fitburst.memory.calibration`) stays
within the device budget less the headroom (``preflight.safety_margin``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitburst.hardware import Device
from fitburst.settings import RunSettings
from fitburst.spec import SAFETY_MARGIN

from .calibration import RunFacts, band_for
from .estimator import Estimate
from .fsdp_terms import host_bytes


@dataclass(frozen=True)
class Budget:
    """What a plan must stay within on ``device``: budget x (1 - headroom), against the band's upper edge.

    ``scout``: judge an analytic (or sliced) estimate as a predictor of the exact (traced) one that will verify the
    plan: a plan is worth tracing when the most favourable trace its figure allows (the analytic-vs-traced or
    sliced-vs-traced band's low edge) fits at the traced band's upper edge. The exact check then decides; nothing
    is accepted on this."""

    device: Device
    headroom: float = SAFETY_MARGIN
    scout: bool = False
    gpus_per_node: int = 1  # a sharded run's GPUs on one node (more ranks than this span several nodes)
    host_limit: int | None = None  # host RAM a node has for the run's host side (None: not checked)

    @property
    def limit(self) -> int:
        return int(self.device.budget_bytes * (1 - self.headroom))

    def judge(self, e: Estimate) -> Estimate:
        """Mark ``e`` with its band, the headroom and whether it fits (for a scout: whether it is worth tracing); a
        sharded run also with its nodes and the host RAM each needs (:func:`host_bytes`), and an offloaded one with
        the pinned host RAM its offloaded activations take (fitburst.memory.host): the host side must fit too."""
        e.band = band_for(e.method, self.device.kind, _kbit(e), self.device.name, e.world_size, self.facts(e))
        e.safety_margin = self.headroom
        per_node = 1
        if e.world_size > 1:
            per_node = min(e.world_size, self.gpus_per_node)
            e.nodes = -(-e.world_size // per_node)
            e.host_bytes = host_bytes(e.params, RunSettings.from_dict(e.settings), per_node)
        if e.host_side_bytes:  # each process's offloaded activations (pinned) and host-resident embedding table
            e.host_bytes = (e.host_bytes if e.world_size > 1 else 0) + e.host_side_bytes * per_node
        e.fits = self.needed(e) <= self.limit and self.host_fits(e)
        return e

    def host_fits(self, e: Estimate) -> bool:
        return self.host_limit is None or e.host_bytes <= self.host_limit

    def needed(self, e: Estimate) -> int:
        """The most ``e``'s run may need: its reserved figure at the band's upper edge."""
        kind, kbit = self.device.kind, _kbit(e)
        if self.scout:
            lowest = int(e.reserved_peak_bytes * (1 + band_for(f"{e.method}-vs-traced", kind, kbit, None,
                                                                e.world_size).low))
            return band_for("traced", kind, kbit, self.device.name, e.world_size, self.facts(e)).upper(lowest)
        band = e.band or band_for(e.method, kind, kbit, self.device.name, e.world_size, self.facts(e))
        return band.upper(e.reserved_peak_bytes)

    def facts(self, e: Estimate) -> RunFacts:
        """What of ``e``'s run decides whether a GPU's measured band covers it."""
        s = e.settings
        quant = s.get("quant", "none")
        dq = "+dq" if s.get("double_quant") and quant in ("nf4", "fp4") else ""
        return RunFacts(params=e.params.get("base", e.params.get("total")), vocab=e.vocab or None,
                        card=e.reserved_peak_bytes / self.device.total_bytes if self.device.total_bytes else None,
                        attention=s.get("attention"), quant=quant + dq, world_size=e.world_size)

    def margin(self, e: Estimate) -> int:
        """Bytes left under the limit at the band's upper edge (negative: by how much it misses)."""
        return self.limit - self.needed(e)


def _kbit(e: Estimate) -> bool:
    return e.settings.get("quant", "none") != "none"
