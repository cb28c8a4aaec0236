"""Peak anonymous memory (sampled RssAnon) while fitburst.models.load_model loads a model, against one copy of its
weights. ``python tests/load_peak_child.py DTYPE [--second-copy]`` prints JSON. Run with MALLOC_MMAP_THRESHOLD_
pinned so freed memory leaves RSS."""

from __future__ import annotations

import copy
import json
import sys
import threading
import time


def anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main() -> None:
    import torch
    import transformers  # noqa: F401 - imported before the baseline

    from fitburst.demo_models import demo_model_dir
    from fitburst.models import load_model

    path = demo_model_dir(hidden_size=512, num_hidden_layers=4)  # ~13 M params, saved in fp32
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[1]]
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.002)

    base = anon()
    sampler = threading.Thread(target=sample)
    sampler.start()
    model = load_model(str(path), dtype=dtype, device="cpu")
    extra = copy.deepcopy(model) if "--second-copy" in sys.argv else None  # a negative control
    time.sleep(0.05)
    stop.set()
    sampler.join()
    one = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak_bytes": peak[0] - base, "one_copy_bytes": one, "second": extra is not None}))


if __name__ == "__main__":
    main()
