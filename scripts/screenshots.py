"""Screenshots of the MLflow run page and the Prefect flow-run page of a demo run, for docs/img/ (not a test).

Starts an MLflow server and a Prefect server on free local ports with stores in a temp folder, runs the demo
pipeline against them, then captures the pages with headless Chromium (Debian: `apt-get install chromium`).

    .venv/bin/python scripts/screenshots.py [--out docs/img] [--chromium chromium]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url} did not answer in {timeout:.0f}s")


def shoot(chromium: str, url: str, dest: Path, width: int = 1440, height: int = 1000, wait_ms: int = 60000) -> None:
    """One page as PNG, after ``wait_ms`` of virtual time for the single-page app to fetch and render."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={width},{height}",
                        f"--virtual-time-budget={wait_ms}", "--run-all-compositor-stages-before-draw",
                        f"--screenshot={dest}", url],
                       check=True, capture_output=True, timeout=180)
    from PIL import Image

    img = Image.open(dest).convert("RGB")  # palette PNG: a fraction of the size, text stays sharp
    img.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(dest, optimize=True)
    print(f"{dest} ({dest.stat().st_size // 1024} KiB) <- {url}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or "chromium")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix="fitburst-shots-"))
    mport, pport = free_port(), free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{pport}/api", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mport}", "FITBURST_RUNS_DIR": str(tmp / "runs"),
           "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mport),
                          "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--artifacts-destination",
                          str(tmp / "mlartifacts")], cwd=tmp, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL),
        subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(pport)],
                         cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    try:
        wait_http(f"http://127.0.0.1:{mport}/health")
        wait_http(f"http://127.0.0.1:{pport}/api/health")
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

        mrun = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(summary["mlflow_run_id"])
        exp, rid, frid = mrun.info.experiment_id, mrun.info.run_id, mrun.data.tags["prefect.flow_run_id"]
        base = f"http://127.0.0.1:{mport}/#/experiments/{exp}"
        ml = "?workflowType=machine_learning"  # MLflow 3.17's UI keeps GenAI vs model training per browser
        shoot(args.chromium, f"{base}/runs/{rid}{ml}", out / "mlflow-run.png", height=1500)
        shoot(args.chromium, f"{base}/runs/{rid}/system-metrics{ml}", out / "mlflow-system-metrics.png", height=1100)
        model_id = mrun.outputs.model_outputs[0].model_id
        shoot(args.chromium, f"{base}/models/{model_id}{ml}", out / "mlflow-logged-model.png", height=1100)
        shoot(args.chromium, f"http://127.0.0.1:{mport}/#/models/fitburst-demo{ml}", out / "mlflow-registry.png",
              height=700)
        shoot(args.chromium, f"http://127.0.0.1:{pport}/runs/flow-run/{frid}", out / "prefect-flow-run.png",
              height=1100)
        for key in ("training-demo", "preflight-table-demo"):
            req = urllib.request.Request(f"{env['PREFECT_API_URL']}/artifacts/filter", method="POST",
                                         data=json.dumps({"artifacts": {"key": {"any_": [key]}}}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                artifact_id = json.load(r)[0]["id"]
            shoot(args.chromium, f"http://127.0.0.1:{pport}/artifacts/artifact/{artifact_id}",
                  out / f"prefect-{key}.png", height=900)
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
