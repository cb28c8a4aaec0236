"""Cloud burst: choose a rented GPU from need and price, run the same ``fitburst train`` there via SkyPilot,
bring the results home, and always tear the cluster down. The only package that imports ``sky`` (lazily)."""

from fitburst.cloud.gpus import Offer, offers
from fitburst.cloud.launch import BurstFailed, BurstResult, LogStream, burst_train, explain_launch_error
from fitburst.cloud.rank import Candidate, budget_problems, rank_candidates
from fitburst.cloud.task import (
    TASK_YAML,
    BudgetError,
    BurstError,
    build_task,
    check_budget,
    collect_secrets,
    dry_run_report,
    task_yaml,
)

__all__ = [
    "TASK_YAML",
    "BudgetError",
    "BurstError",
    "BurstFailed",
    "BurstResult",
    "Candidate",
    "LogStream",
    "Offer",
    "budget_problems",
    "build_task",
    "burst_train",
    "check_budget",
    "collect_secrets",
    "dry_run_report",
    "explain_launch_error",
    "offers",
    "rank_candidates",
    "task_yaml",
]
