"""Screenshots of a demo run in MLflow and Prefect for docs/img/, as docs/ui.md shows them (not a test).

One command: it starts an MLflow server and a Prefect server on free local ports with their stores in a temp
folder, runs the demo pipeline against them, then drives headless Chromium through each page with Playwright,
waiting for the elements each shot is about (never a fixed sleep), and writes palette PNGs 1440 px wide.

Needs Playwright and a Chromium, which scripts/setup.sh does not install:

    .venv/bin/pip install -e '.[docs]'                 # playwright
    apt-get install chromium                           # Debian's; or: .venv/bin/playwright install chromium
    .venv/bin/python scripts/screenshots.py [--out docs/img] [--chromium /usr/bin/chromium]

Without ``--chromium`` it uses the ``chromium`` on PATH, else the one ``playwright install`` downloaded.

MLflow 3.17's UI opens its assistant panel by itself on a browser's first visit to a server on localhost (it then
sets the local-storage flag ``mlflow.assistant.fab.autoOpenedOnFirstLoad_v1``), and keeps the GenAI vs model-training
choice per browser (``mlflow.workflowType_v1``). Every page here loads with the flag set, the panel closed
(``mlflow.assistant.panelOpen_v1``) and the model-training view chosen; a shot fails if the panel shows anyway.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.entities import Run
    from playwright.sync_api import Browser, Locator, Page

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WIDTH = 1440
TIMEOUT_MS = 120_000  # per awaited element: generous, the UIs render slowly on a loaded 2-core machine

MLFLOW_LOCAL_STORAGE = {  # the keys and JSON values MLflow 3.17's UI reads (useLocalStorage: "<key>_v<version>")
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True,
    "mlflow.assistant.panelOpen_v1": False,
    "mlflow.workflowType_v1": "machine_learning",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url} did not answer in {timeout:.0f}s")


def stable(locator: Locator, interval_ms: int = 500, timeout_s: float = 60) -> None:
    """Until two pictures of ``locator`` taken ``interval_ms`` apart are the same: for what draws on a canvas or
    animates (Prefect's run graph, Plotly's charts), where no element says it has finished drawing."""
    locator.wait_for(timeout=TIMEOUT_MS)
    deadline, last = time.time() + timeout_s, b""
    while time.time() < deadline:
        shot = locator.screenshot(animations="disabled")
        if shot == last:
            return
        last = shot
        locator.page.wait_for_timeout(interval_ms)
    raise SystemExit(f"{locator} kept changing for {timeout_s:.0f}s")


def save(page: Page, dest: Path) -> None:
    """The viewport as a palette PNG (a fraction of the size of RGB, text stays sharp)."""
    from PIL import Image

    page.evaluate("document.fonts.ready.then(() => true)")
    page.screenshot(path=dest, animations="disabled")
    Image.open(dest).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(dest, optimize=True)
    print(f"{dest} ({dest.stat().st_size // 1024} KiB) <- {page.url}")


def mlflow_page(browser: Browser, url: str, height: int) -> Page:
    ctx = browser.new_context(viewport={"width": WIDTH, "height": height})
    ctx.set_default_timeout(TIMEOUT_MS)
    ctx.add_init_script("".join(f"localStorage.setItem({k!r}, {json.dumps(json.dumps(v))});"
                                for k, v in MLFLOW_LOCAL_STORAGE.items()))
    page = ctx.new_page()
    page.goto(url)
    return page


def no_assistant(page: Page) -> None:
    if page.locator('[data-component-id^="mlflow.assistant.chat_panel"]').count():  # the panel's own elements
        raise SystemExit(f"the MLflow assistant panel is open on {page.url}: see this script's docstring")


def shoot_mlflow(browser: Browser, base: str, run: Run, out: Path) -> None:
    """Run overview, its system-metric charts, the logged model's MLmodel, the registered model."""
    from mlflow.tracking import MlflowClient

    exp, rid = run.info.experiment_id, run.info.run_id
    exp_url = f"{base}/#/experiments/{exp}"

    # tall enough for the parameters and the logged-models table below them
    page = mlflow_page(browser, f"{exp_url}/runs/{rid}", 1750)
    page.get_by_text(rid).first.wait_for()
    page.get_by_text("instructions-train").first.wait_for()  # the dataset inputs
    page.get_by_role("link", name="fitburst-demo").first.wait_for()  # registered model version
    page.get_by_text("Ready", exact=True).first.wait_for()  # the logged model's row
    no_assistant(page)
    save(page, out / "mlflow-run.png")
    page.context.close()

    # Charts are drawn only once in the viewport (the old shots' blank panels were charts not drawn yet), so
    # the viewport holds every row: 3 charts a row, about 370 px each, below about 260 px of header.
    system = [k for k in run.data.metrics if k.startswith("system/")]
    client = MlflowClient(base)
    points = min(len(client.get_metric_history(rid, k)) for k in system)
    if points < 3:
        print(f"warning: only {points} samples per system metric: the training was short for a 1 s sampler",
              file=sys.stderr)
    page = mlflow_page(browser, f"{exp_url}/runs/{rid}/system-metrics", 260 + 370 * math.ceil(len(system) / 3))
    page.wait_for_function("n => document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length >= n",
                           arg=len(system), timeout=TIMEOUT_MS)
    for chart in page.locator(".js-plotly-plot").all():
        stable(chart)
    no_assistant(page)
    save(page, out / "mlflow-system-metrics.png")
    page.context.close()

    # the logged model's Artifacts tab: MLmodel (flavors, PEFT adaptor and base path, signature), peft/ unfolded
    if run.outputs is None or not run.outputs.model_outputs:
        raise SystemExit(f"run {rid} logged no model: is tracking.log_model off for the demo pipeline?")
    model_id = run.outputs.model_outputs[0].model_id
    page = mlflow_page(browser, f"{exp_url}/models/{model_id}/artifacts", 1100)
    page.get_by_label("peft", exact=True).click()
    page.get_by_text("adapter_config.json").wait_for()
    page.get_by_text("MLmodel", exact=True).click()
    page.get_by_text("peft_adaptor").wait_for()
    page.get_by_text("signature", exact=True).wait_for()
    no_assistant(page)
    save(page, out / "mlflow-logged-model.png")
    page.context.close()

    page = mlflow_page(browser, f"{base}/#/models/fitburst-demo", 700)
    page.get_by_role("link", name="Version 1").wait_for()
    page.get_by_title("champion").wait_for()  # the alias tag
    no_assistant(page)
    save(page, out / "mlflow-registry.png")
    page.context.close()


def shoot_prefect(browser: Browser, base: str, flow_run_id: str, out: Path) -> None:
    """The flow run (graph and logs) and two of its artifacts."""
    ctx = browser.new_context(viewport={"width": WIDTH, "height": 1300})
    ctx.set_default_timeout(TIMEOUT_MS)
    page = ctx.new_page()
    page.goto(f"{base}/runs/flow-run/{flow_run_id}")
    page.locator(".log-row", has_text="preflight demo:").wait_for()
    page.locator(".log-row", has_text="step 10/").wait_for()
    stable(page.locator(".run-graph__stage canvas"))
    save(page, out / "prefect-flow-run.png")

    for key, height, ready in (("training-demo", 600, page.get_by_text("Progress: 100%")),
                               ("preflight-table-demo", 700, page.locator("td").get_by_text("budget", exact=True))):
        req = urllib.request.Request(f"{base}/api/artifacts/filter", method="POST",
                                     data=json.dumps({"artifacts": {"key": {"any_": [key]}}}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            artifact_id = json.load(r)[0]["id"]
        page.set_viewport_size({"width": WIDTH, "height": height})
        page.goto(f"{base}/artifacts/artifact/{artifact_id}")
        ready.wait_for()
        save(page, out / f"prefect-{key}.png")
    ctx.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"),
                    help="Chromium executable (default: chromium on PATH, else Playwright's own download)")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright  # the docs extra: checked before minutes of servers and training

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="fitburst-shots-"))
    mport, pport = free_port(), free_port()
    mlflow_url, prefect_url = f"http://127.0.0.1:{mport}", f"http://127.0.0.1:{pport}"
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"{prefect_url}/api", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_TRACKING_URI": mlflow_url, "FITBURST_RUNS_DIR": str(tmp / "runs"), "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mport),
                          "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--artifacts-destination",
                          str(tmp / "mlartifacts")], cwd=tmp, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL),
        subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(pport)],
                         cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    try:
        wait_http(f"{mlflow_url}/health")
        wait_http(f"{prefect_url}/api/health")
        pipelines = str(ROOT / "pipelines.yaml")
        code = ("import json; from flows.finetune import finetune; "
                f"print('SUMMARY', json.dumps(finetune(pipeline='demo', pipelines_file={pipelines!r}), default=str))")
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True)
        line = next((x for x in run.stdout.splitlines() if x.startswith("SUMMARY ")), None)
        if run.returncode or line is None:
            print(run.stdout[-3000:], run.stderr[-3000:], file=sys.stderr)
            return 1
        summary = json.loads(line[len("SUMMARY "):])
        from mlflow.tracking import MlflowClient

        mrun = MlflowClient(mlflow_url).get_run(summary["mlflow_run_id"])
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium)
            try:
                shoot_mlflow(browser, mlflow_url, mrun, out)
                shoot_prefect(browser, prefect_url, mrun.data.tags["prefect.flow_run_id"], out)
            finally:
                browser.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
