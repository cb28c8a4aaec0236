"""One rank of a real FSDP2 run over gloo (started from tests/test_sharded.py and benchmarks/distributed.py): the
model built from a config.json, prepared and sharded as the loop does
(fitburst.builders.prepare_for_training, fitburst.distributed.shard), two warm-up steps of
fitburst.train.optimizer_step, then one step measured by torch's own MemTracker (live tensor storages, FSDP's
storage resizes included). Rank 0 prints one JSON line per rank and case: {"case", "rank", "peak", "peak_with_gloo",
"losses"}. Several cases of one world size run one after another in the same ranks (each from the same seed, its
model and optimizer freed before the next): a rank process starts once for them, not once per case.

``peak`` leaves out what gloo itself allocates inside FSDP's reduce-scatter: ProcessGroupGloo works on a copy of
the input, made on the calling thread (so MemTracker sees it) and freed by gloo's worker thread, sooner or later
(a full fine-tune's peak moved by up to 6 % from run to run). NCCL, which the trace stands for, reduce-scatters in
place. ``peak_with_gloo`` is a fourth step measured with that copy counted, as gloo runs it.

argv: a JSON list of [model folder, RunSettings as a dict] (the folder: config.json; 4-bit runs: the saved weights,
quantized on load). ``python tests/fsdp_child.py N <json>`` starts the N ranks itself, forked from this process once
it has imported what they import (torch's elastic agent, as fitburst.torchrun starts fitburst's ranks).
"""

import gc
import json
import sys
import uuid

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from fitburst.builders import make_optimizer, prepare_for_training
from fitburst.device import make_amp, torch_dtype, weight_dtype
from fitburst.distributed import shard
from fitburst.memory.trace import _batch
from fitburst.models import auto_model_class, quantization_config
from fitburst.settings import RunSettings, spec_with_settings
from fitburst.spec import PipelineSpec
from fitburst.train import optimizer_step
from fitburst.unused_imports import leave_out, unused_packages


class FrozenAwareTracker(MemTracker):
    """torch's MemTracker, which registers a gradient hook on every parameter: frozen ones (LoRA's base) refuse
    hooks, and their gradients never exist anyway."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)


def count_gloo_internals(counted: list[bool]) -> None:
    """FSDP's reduce-scatter, run with MemTracker's dispatch mode off unless ``counted[0]``: FSDP allocates its
    input and output before the call, so they are counted either way; gloo's own copy only when asked."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.utils._python_dispatch import _disable_current_modes

    real = _fsdp_collectives.DefaultReduceScatter.__call__

    def reduce_scatter(self, *args, **kwargs):
        if counted[0]:
            return real(self, *args, **kwargs)
        with _disable_current_modes():
            return real(self, *args, **kwargs)

    _fsdp_collectives.DefaultReduceScatter.__call__ = reduce_scatter  # type: ignore[method-assign]


def measured(model, opt, step) -> tuple[int, float]:
    """The peak of live tensor bytes over one ``step``, and its loss."""
    tracker = FrozenAwareTracker()
    tracker.track_external(model, opt)
    with tracker:
        loss = step()
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()), loss


def run_case(folder: str, s: RunSettings) -> dict:
    """One case on this rank: its model built, prepared and sharded, two warm-up steps, two measured ones."""
    torch.manual_seed(0)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    cls = auto_model_class(config)
    if s.kbit:
        model = cls.from_pretrained(folder, dtype=torch_dtype(s.precision), device_map="cpu",
                                    attn_implementation="sdpa",
                                    quantization_config=quantization_config(s.quant, s.double_quant,
                                                                            torch_dtype(s.precision), sharded=True))
    else:
        model = cls.from_config(config, dtype=weight_dtype(s.precision, s.method, s.pure_bf16),
                                attn_implementation="sdpa")
    spec = spec_with_settings(PipelineSpec.model_validate(
        {"name": "fsdp", "model": {"name": folder}, "data": {"path": "unused.jsonl"}}), s)
    model = prepare_for_training(model, spec)
    shard(model, s.precision, reshard_after_forward=s.reshard_after_forward, pure_bf16=s.pure_bf16)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(s.optimizer, params, 1e-3, 0.0)
    amp = make_amp(s.precision, "cpu", pure_bf16=s.pure_bf16)
    padded = s.micro_batch_size > 1 if s.padded is None else s.padded

    def step() -> float:
        micro = [_batch(s.micro_batch_size, s.seq_len, padded) for _ in range(s.grad_accum)]
        return optimizer_step(model, opt, params, micro, device="cpu", max_grad_norm=1.0, amp=amp)

    GLOO_COUNTED[0] = False
    losses = [step(), step()]
    peak, loss = measured(model, opt, step)
    GLOO_COUNTED[0] = True
    peak_with_gloo, loss_with_gloo = measured(model, opt, step)
    return {"rank": dist.get_rank(), "peak": peak, "peak_with_gloo": peak_with_gloo,
            "losses": [*losses, loss, loss_with_gloo]}


GLOO_COUNTED = [False]


def main(cases_json: str) -> None:
    cases = json.loads(cases_json)
    # as a rank of fitburst's does (fitburst.unused_imports): what none of the cases calls stays unimported
    leave_out(unused_packages(*(RunSettings(**settings) for _, settings in cases)))
    dist.init_process_group("gloo")
    count_gloo_internals(GLOO_COUNTED)
    for i, (folder, settings) in enumerate(cases):
        row = run_case(folder, RunSettings(**settings))
        gc.collect()  # the case's model and optimizer: nothing of it is live when the next one is measured
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, {"case": i, **row})
        if dist.get_rank() == 0:  # one writer: lines of several processes would interleave
            print("\n".join(json.dumps(r) for r in rows), flush=True)
    dist.destroy_process_group()


def forked_ranks(world_size: int, cases_json: str) -> None:
    """:func:`main` on ``world_size`` ranks forked from this process (a standalone rendezvous, as torchrun's)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="fork")
    sys.stdout.flush()
    elastic_launch(config, entrypoint=main)(cases_json)


if __name__ == "__main__":
    forked_ranks(int(sys.argv[1]), sys.argv[2])
