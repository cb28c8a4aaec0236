"""T5's loss on a GPU, traced: what each GPU's autocast does to a loss of 16-bit logits, and the analytic figure.

T5 takes ``cross_entropy`` of its 16-bit logits with no upcast first. CPU autocast casts the whole op to fp32 (an
fp32 copy of the logits, fp32 log-probabilities); CUDA's and MPS's autocast leave ``cross_entropy_loss`` alone and
autocast only its inner ops: 16-bit log-probabilities (``log_softmax`` keeps its input's dtype there) and an fp32
copy of them for ``nll_loss``. The trace follows each device's autocast
(:func:`fitburst.memory.autocast_policy.device_autocast`). This benchmark traces the same steps twice: as the trace
runs them for the GPU today, and with ``cross_entropy_loss`` left to CPU autocast (as the trace ran it before the
GPU rule), and prints both allocated peaks beside the analytic estimate's.

The model: FLAN-T5's layout at test size (gated-gelu, dropout 0.1, a separate lm_head; d_model 128, 2 + 2 layers)
with FLAN-T5's 32,128-token vocabulary, so the loss is most of the peak; LoRA r8 on q, v, SDPA, no lora dropout.
Devices: T4 (fp16), L4 (bf16), a 16 GiB MPS device (bf16); 2 x 512 and 4 x 1,024 tokens. Nothing here is a
measurement of a GPU: both columns are traces (FakeTensorMode, the device's kernel rules, on CUDA the
caching-allocator replay's allocated peak).

    python benchmarks/t5_gpu_trace.py          (about a minute on the 2-core box)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitburst.memory import RunSettings, autocast_policy, estimate, load_shape, resolve_device  # noqa: E402
from fitburst.memory.trace import traced_estimate  # noqa: E402
from fitburst.spec import PipelineSpec  # noqa: E402

# the same layout as tests/test_seq2seq.py's T5_CFG, with FLAN-T5's vocabulary
T5_CFG = dict(model_type="t5", d_model=128, d_kv=32, d_ff=320, num_layers=2, num_decoder_layers=2, num_heads=4,
              vocab_size=32128, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.1,
              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
DEVICES = [("T4", "fp16"), ("L4", "bf16"), ("mps:16GiB", "bf16")]
SHAPES = [(2, 512), (4, 1024)]
MiB = 1 << 20


@contextlib.contextmanager
def loss_under_cpu_autocast() -> Iterator[None]:
    """``cross_entropy_loss`` cast to fp32 as CPU autocast casts it (the device's rules for every other op kept)."""
    kept = autocast_policy.NOT_AUTOCAST
    autocast_policy.NOT_AUTOCAST = tuple(n for n in kept if n != "cross_entropy_loss")
    try:
        yield
    finally:
        autocast_policy.NOT_AUTOCAST = kept


def main() -> None:
    os.environ["FITBURST_TRACE_CACHE"] = "0"  # both variants traced, neither served from the on-disk cache
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(T5_CFG))
        spec = PipelineSpec.model_validate(dict(name="t5", model={"name": d}, data={"path": "x.jsonl"}))
        shape = load_shape(d)
        print("T5 (FLAN-T5 layout, vocabulary 32,128), LoRA r8 q,v, SDPA; allocated peaks, MiB")
        print("| device | dtype | batch x tokens | traced, the device's autocast | traced, loss under CPU autocast "
              "| device rule vs CPU rule | analytic | analytic / traced - 1 |")
        print("|---|---|---|---:|---:|---:|---:|---:|")
        for name, dtype in DEVICES:
            device = resolve_device(name)
            for b, seq in SHAPES:
                s = RunSettings(method="lora", rank=8, micro_batch_size=b, seq_len=seq, precision=dtype,
                                attention="sdpa", dropout=0.0, target_modules=["q", "v"], keep_logits=False)
                gpu = traced_estimate(spec, s, device, seq_len=seq).allocated_peak_bytes
                with loss_under_cpu_autocast():
                    cpu = traced_estimate(spec, s, device, seq_len=seq).allocated_peak_bytes
                analytic = estimate(shape, s, device, calibrate=False).allocated_peak_bytes
                print(f"| {name} | {dtype} | {b} x {seq:,} | {gpu / MiB:,.1f} | {cpu / MiB:,.1f} | "
                      f"{gpu / cpu - 1:+.1%} | {analytic / MiB:,.1f} | {analytic / gpu - 1:+.1%} |")


if __name__ == "__main__":
    main()
