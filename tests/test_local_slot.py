"""The local-GPU concurrency slot is held from the preflight through training: while another holder has it, a flow
run's preflight does not start; once released, the run goes on and gives the slot back at its end."""

from __future__ import annotations

import threading
import time

from tasks.train import LOCAL_TRAIN_TAG


def local_gpu_limit() -> str:
    """The local-GPU concurrency limit as `fitburst serve` creates it (limit 1), fresh; returns its name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    name = f"tag:{LOCAL_TRAIN_TAG}"
    with get_client(sync_client=True) as c:
        try:
            c.delete_global_concurrency_limit_by_name(name)
        except Exception:  # noqa: BLE001 - not there yet
            pass
        c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    return name


def test_preflight_waits_for_the_local_gpu_slot(prefect_server, pipelines_file, tmp_path, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    from flows.finetune import finetune

    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path))
    name = local_gpu_limit()

    events: dict[str, float] = {}
    import tasks.preflight as pre_mod

    real = pre_mod.preflight

    def timed_preflight(*a, **kw):
        events.setdefault("preflight", time.monotonic())
        return real(*a, **kw)

    monkeypatch.setattr(pre_mod, "preflight", timed_preflight)
    import flows.finetune as flow_mod

    prepared = threading.Event()
    real_prep = flow_mod.data_prep

    def prep(*a, **kw):
        try:
            return real_prep(*a, **kw)
        finally:
            prepared.set()

    monkeypatch.setattr(flow_mod, "data_prep", prep)
    out: dict = {}
    overrides = {"training.max_steps": 3, "eval.enabled": False}
    run = threading.Thread(target=lambda: out.update(finetune("demo", overrides, str(pipelines_file))))
    with concurrency(name, occupy=1):  # another run's training holds the GPU
        run.start()
        assert prepared.wait(timeout=180)
        time.sleep(3)  # the preflight would have started by now
        assert "preflight" not in events, "the preflight ran while another run held the local GPU"
        events["released"] = time.monotonic()
    run.join(timeout=240)
    assert out.get("steps") == 3 and events["preflight"] >= events["released"]
    with get_client(sync_client=True) as c:
        assert c.read_global_concurrency_limit_by_name(name).active_slots == 0  # given back at the end


def test_two_local_runs_never_overlap_from_preflight_to_eval(prefect_server, pipelines_file, demo_prepared, tmp_path,
                                                              monkeypatch):
    """Two runs started together: each holds the local GPU from its preflight to the end of its eval, so the
    second one's preflight starts only after the first one's eval has ended. (``demo_prepared`` builds the demo
    model and imports transformers first: two threads importing it at once race in its lazy module.)"""
    from prefect import runtime
    from prefect.client.orchestration import get_client

    import flows.finetune as flow_mod
    import tasks.preflight as pre_mod

    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path))
    name = local_gpu_limit()

    spans: dict[str, list[float]] = {}
    real_preflight, real_eval = pre_mod.preflight, flow_mod.evaluate_task

    def timed_preflight(*a, **kw):
        spans.setdefault(str(runtime.flow_run.id), []).append(time.monotonic())
        return real_preflight(*a, **kw)

    def timed_eval(*a, **kw):
        try:
            return real_eval(*a, **kw)
        finally:
            spans[str(runtime.flow_run.id)].append(time.monotonic())

    monkeypatch.setattr(pre_mod, "preflight", timed_preflight)
    monkeypatch.setattr(flow_mod, "evaluate_task", timed_eval)
    outs: list[dict] = [{}, {}]
    overrides = {"training.max_steps": 4, "eval.samples": 1, "eval.max_new_tokens": 4, "eval.max_batches": 1}
    runs = [threading.Thread(target=lambda o=o: o.update(flow_mod.finetune("demo", overrides, str(pipelines_file))))
            for o in outs]
    for r in runs:
        r.start()
    for r in runs:
        r.join(timeout=400)
    assert all(o.get("verdict") == "local" and o.get("steps") == 4 for o in outs), outs
    (a_start, a_end), (b_start, b_end) = sorted(spans.values())
    assert b_start >= a_end, f"the second run's preflight began {a_end - b_start:.1f}s before the first's eval ended"
    with get_client(sync_client=True) as c:
        assert c.read_global_concurrency_limit_by_name(name).active_slots == 0


def test_without_the_limit_a_run_holds_nothing_and_logs_no_warning(prefect_server):
    """A plain `fitburst run` (no `fitburst serve`, so no limit): the slot is a no-op, and the flow run's logs carry
    no "do not exist - skipping acquisition" warning."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    from flows.finetune import local_gpu_slot

    name = f"tag:{LOCAL_TRAIN_TAG}"
    with get_client(sync_client=True) as c:
        try:
            c.delete_global_concurrency_limit_by_name(name)
        except Exception:  # noqa: BLE001 - not there
            pass

    @flow
    def holds_the_slot() -> str:
        from prefect import runtime

        with local_gpu_slot():
            return str(runtime.flow_run.id)

    run_id = holds_the_slot()
    time.sleep(1.5)  # the API log handler sends in batches
    with get_client(sync_client=True) as c:
        assert c.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    assert logs, "the flow run's logs were not sent"
    assert not [log.message for log in logs if "do not exist" in log.message]
