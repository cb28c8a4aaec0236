"""Analytic peak-memory model of one training step of transformers + peft (+ bitsandbytes).

Everything here is arithmetic on the config: no torch, no weights. The step is counted from named terms: the model
states (fitburst.memory.params: weights, adapters, gradients, optimizer state), the activations each block saves
(fitburst.memory.activations), the loss head (its logits and their fp32 copies, or a fused kernel's rule) and the
transients. Each phase of the step (forward end, vision tower, loss, backward, optimizer step, eval) is summed from
them, one function each, and the largest phase is the peak; FSDP's per-rank share is fitburst.memory.fsdp_terms'.
Constants that are measured rather than derived are named.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from fitburst.hardware import Device, GiB, MiB
from fitburst.rules import problems
from fitburst.settings import EVAL_CHUNK_TOKENS, RunSettings

from . import calibration
from .activations import (
    BLOCKS,
    StepContext,
    attention_forward_transient,
    block_backward_transient,
    forward_transient,
    norm,
    step_context,
    vision_activations,
)
from .calibration import ErrorBand
from .cuda_kernels import OFFLOAD_STASH, expanded_kv_note
from .fsdp_terms import fsdp_buffers, packed_4bit, per_rank
from .loss_kernels import describe_lean, fused_eval_bytes, fused_loss_terms, hidden_cast, loss_kernel_of
from .params import ModelStates, embed_head_params, model_states, param_counts, weight_bytes
from .shapes import ModelShape

# CUDA caching allocator: reserved / allocated at a training peak (block rounding, fragmentation), plus a
# floor of segments; MPS heaps are coarser; on CPU glibc keeps freed memory (RSS above tensor bytes), and the
# first training step adds a heap of its own (autograd engine, oneDNN scratch, thread pools, lazily imported
# modules, the batch rows as Python objects; benchmarks/results/tracker_vs_os.txt). On CPU the reserved figure is
# what fitburst.meter measures (VmHWM minus the RSS at the start, unpinned glibc malloc).
# On CUDA the standard loss's fp32 logits blocks (4 x tokens x vocab each) leave segments the later phases cannot
# fill: reserved = allocated x 1.064 + 0.363 x fp32 logits + 31 MiB, least squares on the caching-allocator replays
# of traced steps (fitburst.memory.trace), never on measurements; how it scores against them and why it is kept:
# docs/preflight.md, "How each band was measured". A fused loss makes no such blocks (its logits exist one chunk at
# a time, if at all): the logits term is 0 there (tests/test_trace.py, the fused-loss replays).
RESERVED_FACTOR = {"cuda": 1.064, "mps": 1.15, "cpu": 1.25}
RESERVED_FLOOR = {"cuda": 31 * MiB, "mps": 64 * MiB, "cpu": 32 * MiB}
RESERVED_PER_LOGITS = {"cuda": 0.363, "mps": 0.0, "cpu": 0.0}
# which figure of an estimate fitburst.meter's measured peak (allocated_bytes) compares with, per device kind:
# CUDA max_memory_allocated -> allocated; MPS driver memory and CPU RSS growth -> reserved
MEASURED_COUNTERPART = {"cuda": "allocated_peak_bytes", "mps": "reserved_peak_bytes", "cpu": "reserved_peak_bytes"}



@dataclass
class Estimate:
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    device_total_bytes: int
    components: dict[str, int]
    peak_phase: str
    device: str
    budget_bytes: int
    params: dict[str, int]
    plan: list[str] = field(default_factory=list)
    phases: dict[str, int] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    model: str = ""
    safety_margin: float = 0.0
    notes: list[str] = field(default_factory=list)
    calibration_factor: float = 1.0  # applied to the peak (fitburst calibrate); 1.0: the analytic model alone
    reserved_calibration_factor: float = 1.0  # applied to the reserved figure (CUDA: fitted on its own)
    method: str = "analytic"  # analytic | traced: which error band (fitburst.memory.calibration) applies
    band: ErrorBand | None = None  # set by Budget.judge (fitburst.memory.budget): the band the fit was judged by
    fits: bool | None = None  # set by Budget.judge: None until judged against a budget
    # several GPUs (FSDP): every figure above is one GPU's (each rank holds as much); ``host_bytes``: the host RAM one
    # node needs for the run beyond the processes themselves (:func:`host_bytes`)
    world_size: int = 1
    nodes: int = 1
    host_bytes: int = 0
    # activation offloading: what one GPU's process keeps in pinned host memory (fitburst.memory.host); part of
    # ``host_bytes`` once judged
    offloaded_host_bytes: int = 0
    vocab: int = 0  # the model's vocabulary (0: not known); with the rest, what decides which band applies

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headroom_bytes"] = self.budget_bytes - self.device_total_bytes + self._context()
        d["gpus_per_node"] = self.world_size // max(self.nodes, 1)
        d["totals"] = {k: getattr(self, k) * self.world_size  # across all GPUs of the run
                       for k in ("allocated_peak_bytes", "reserved_peak_bytes", "device_total_bytes")}
        d["host_bytes_total"] = self.host_bytes * self.nodes
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Estimate:
        """Back from :meth:`to_dict` (an estimate that crossed a process boundary as JSON)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if kw.get("band"):
            kw["band"] = ErrorBand(**kw["band"])
        return cls(**kw)

    def comparable_bytes(self, kind: str) -> int:
        """The figure a measured peak (``MemoryPeak.allocated_bytes``) on a ``kind`` device compares with."""
        return int(getattr(self, MEASURED_COUNTERPART.get(kind, "allocated_peak_bytes")))

    def _context(self) -> int:
        return self.device_total_bytes - self.reserved_peak_bytes

    def to_markdown(self) -> str:
        g = lambda b: f"{b / GiB:,.2f}"  # noqa: E731
        lines = [
            f"**{self.model}** on **{self.device}**: peak {g(self.device_total_bytes)} GiB of "
            f"{g(self.budget_bytes + self._context())} GiB "
            f"({'fits' if self.fits else 'does not fit'}; peak phase: {self.peak_phase})",
            "",
            "| component | GiB |",
            "|---|---:|",
        ]
        for k, v in sorted(self.components.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {k} | {g(v)} |")
        lines += [
            f"| **allocated peak** | **{g(self.allocated_peak_bytes)}** |",
            f"| reserved (allocator) | {g(self.reserved_peak_bytes)} |",
            f"| + context = device total | {g(self.device_total_bytes)} |",
            f"| budget | {g(self.budget_bytes)} |",
        ]
        if self.plan:
            lines += ["", "Plan:"] + [f"- {c}" for c in self.plan]
        if self.notes:
            lines += [""] + [f"_{n}_" for n in self.notes]
        return "\n".join(lines)


# --- the step's terms ----------------------------------------------------------------------------------------

# TRL's offloading numbers every tensor saved outside a checkpoint and keeps the device originals of the last
# OFFLOAD_STASH numbers: after the last block's input come the final norm's (its input, saved by pow and by the
# product with rsqrt, rsqrt, and its weight, numbered though a parameter stays), so the last block's input is left
HEAD_PACKS = 4


@dataclass(frozen=True)
class Activations:
    """What the forward leaves for the backward (bytes), block by block and beside the blocks."""

    per_block: list[int]  # what each block saves for backward
    kept: list[int]  # what each block keeps through the forward (with checkpointing: its input alone)
    recomputed: list[int]  # what checkpointing recomputes of each block for its backward
    top_sublayer: list[int]  # each block's MLP and its norm: their backward runs first and frees them
    head_input: int  # the final norm's saved tensors and (a trained head) its input
    shared: int  # one per step: RoPE's cos/sin, the attention mask, ids and labels, pixels, position biases
    mask: int  # the attention mask (among ``shared``)
    adapter_copies: int  # autocast's 16-bit copies of the fp32 adapters (cached through the forward)
    vision_saved: int  # what a trained vision tower saves
    vision_forward: int  # the vision tower's forward transient
    offloaded: bool  # each block's tensors wait in host memory (CUDA activation offloading)
    checkpointed: bool = False
    # the embeddings' output, a leaf that needs grad (enable_input_require_grads: LoRA with checkpointing), held
    # by autograd's graph through forward and backward: with frozen 16-bit embeddings their 16-bit output (the
    # stream is its fp32 copy, the first block's input); offloaded, that first input itself, whose device original
    # the offloading does not free (in backward only: the forward's is in ``blocks_on_device``)
    embed_leaf: int = 0
    leaf_input: int = 0

    @property
    def blocks_on_device(self) -> int:
        """Of the blocks' kept tensors, what the device holds at the forward's end. Offloaded with checkpointing
        (one saved tensor per block, the checkpoint's input): the device originals of the last ``OFFLOAD_STASH``
        offloaded tensors, which TRL's forward stash keeps until their copies are done, and the first block's input,
        which the model's forward holds (``inputs_embeds``) until it returns; offloaded without checkpointing, one
        block's worth (the block whose tensors came back in backward)."""
        if not self.offloaded:
            return sum(self.kept)
        if not self.checkpointed:
            return max(self.kept, default=0)
        last = self.kept[-OFFLOAD_STASH:]
        return sum(last) + (self.kept[0] if len(self.kept) > len(last) else 0)

    @property
    def offloaded_bytes(self) -> int:
        """What waits in pinned host memory at the forward's end when offloaded (0 otherwise): every block's
        saved tensors (with checkpointing: its input, the checkpoint), the head input and a trained vision
        tower's."""
        return sum(self.kept) + self.head_input + self.vision_saved if self.offloaded else 0

    @property
    def at_loss(self) -> int:
        """What the loss sees beside it: the forward's end, but offloaded with checkpointing the model's forward has
        let go of the first block's input, and the final norm's packed tensors (``HEAD_PACKS``) have taken their
        places in the forward stash, which keeps the inputs of the last ``OFFLOAD_STASH - HEAD_PACKS`` blocks."""
        if not (self.offloaded and self.checkpointed):
            return self.at_forward_end
        last = self.kept[len(self.kept) - OFFLOAD_STASH + HEAD_PACKS:]
        return self.at_forward_end - self.blocks_on_device + sum(last)

    @property
    def at_forward_end(self) -> int:
        return (self.blocks_on_device + self.head_input + self.shared + self.adapter_copies + self.vision_saved
                + self.embed_leaf)


def saved_activations(shape: ModelShape, s: RunSettings, device: Device, c: StepContext, trained: int) -> Activations:
    """The step's saved activations: every block's (:data:`fitburst.memory.activations.BLOCKS`), the head input,
    the tensors every block reads, and a vision tower's; ``trained``: the adapters' values (their 16-bit copies)."""
    ckpt = s.gradient_checkpointing
    per_block, saved, top, last_needs_grad = _blocks(shape, c, ckpt)
    head_input: dict[str, int] = {}  # the final norm (on the last block's output) and the lm_head input
    norm(head_input, "lnf", "xL", last_needs_grad, c, shape, shape.hidden)
    if c.full:
        head_input["nf"] = c.act_bytes * c.tokens * shape.hidden
    mask = c.rows * c.seq * c.seq if c.padded else 0  # boolean padding mask, built once per forward
    if c.attention == "eager":
        mask = c.act_bytes * c.rows * c.seq * c.seq  # eager always gets an additive float mask
    block_input = c.act_bytes * c.tokens * shape.hidden
    if ckpt:  # checkpointing keeps each block's input (fp32 with master weights) and recomputes the rest
        kept = [(4 if c.master else c.act_bytes) * c.tokens * shape.hidden] * len(per_block)
        recomputed = [max(0, x - (block_input if "x" in sv else 0)) for x, sv in zip(per_block, saved, strict=True)]
    else:
        kept, recomputed = per_block, [0] * len(per_block)
    vision_saved, vision_forward = vision_activations(shape, s, c.act_bytes, c.attention, c.mask_b)
    offloaded = s.activation_offloading and device.kind == "cuda"
    leaf = ckpt and c.lora and bool(kept)  # enable_input_require_grads
    return Activations(
        per_block=per_block, kept=kept, recomputed=recomputed, top_sublayer=top, head_input=sum(head_input.values()),
        shared=_shared(shape, s, c, mask), mask=mask,
        adapter_copies=c.dtype_bytes * trained if c.lora16 and not c.fsdp_mp else 0,
        vision_saved=vision_saved, vision_forward=vision_forward, offloaded=offloaded, checkpointed=ckpt,
        embed_leaf=c.dtype_bytes * c.tokens * shape.hidden if leaf and s.frozen_16bit else 0,
        leaf_input=kept[0] if leaf and offloaded and not s.frozen_16bit else 0)


def _blocks(shape: ModelShape, c: StepContext, ckpt: bool) -> tuple[list[int], list[dict], list[int], bool]:
    """(bytes each block saves, its saved tensors by name, its top sub-layer's bytes, whether the last block's output
    needs grad). Block 0's input needs grad with trainable embeddings (full) or enable_input_require_grads (ckpt,
    k-bit + ckpt); an encoder-decoder's decoder starts over from there."""
    first_needs_grad = c.full or ckpt
    block = BLOCKS[shape.arch.block]
    per_block: list[int] = []
    saved: list[dict] = []
    top: list[int] = []
    needs_grad = first_needs_grad
    for count, decoder in shape.blocks():
        for _ in range(count):
            sv, needs_grad, top_bytes = block(shape, c, needs_grad, decoder)
            per_block.append(sum(sv.values()))
            saved.append(sv)
            top.append(top_bytes)
        if shape.encoder_layers and not decoder:
            needs_grad = first_needs_grad
    return per_block, saved, top, needs_grad


def _shared(shape: ModelShape, s: RunSettings, c: StepContext, mask: int) -> int:
    """Tensors of the step every block reads: RoPE's cos/sin, the mask, ids/labels, relative position biases, and
    the batch's pixel_values (fp32, alive through the step)."""
    rope = 2 * c.act_bytes * c.tokens * shape.head_dim
    shared = rope + mask + 16 * c.tokens
    if shape.arch.position_bias:
        shared += _position_biases(shape, s, c)
    v = shape.vision
    pixels = 4 * s.micro_batch_size * s.images * s.image_tokens * v.merge ** 2 * v.patch_in if v is not None else 0
    return shared + pixels


def _position_biases(shape: ModelShape, s: RunSettings, c: StepContext) -> int:
    """The relative position biases (T5) a step keeps beside its blocks."""
    heads, seq = shape.heads, c.seq
    bias_bytes = 4 if s.master_weights or s.precision == "fp32" else c.dtype_bytes  # the weights' dtype
    if c.mask_b == 1:
        # CUDA: each attention call keeps its own bias (t5_block's attention); every cross-attention keeps the one
        # zero bias when no padding mask makes one per call; checkpointed blocks keep the encoder's and the decoder's
        # relative-position biases (1 x heads x S x S, the weights' dtype) and that zero bias as inputs
        return (0 if c.padded else c.act_bytes * heads * seq * seq) + (
            2 * heads * seq * seq * bias_bytes if s.gradient_checkpointing else 0)
    if s.gradient_checkpointing:
        # the position-bias masks (encoder self, decoder self and cross: b x heads x S x S in the weights' dtype)
        # are inputs every checkpointed block keeps
        return 3 * c.rows * heads * seq * seq * bias_bytes
    return 0


@dataclass(frozen=True)
class Loss:
    """The loss head: its kernel and what it holds beyond the activations."""

    kernel: str  # standard, or the fused linear cross-entropy's (fitburst.memory.loss_kernels)
    logits: int  # the full logits of the standard loss
    kept_logits: int  # the logits the loop keeps alive through backward and the optimizer step
    peak: int  # the most the loss holds (forward or backward)
    head_copy: int  # autocast's 16-bit copy of an fp32 head (master weights, k-bit's fp32 head), kept for backward

    @property
    def fused(self) -> bool:
        return self.kernel != "standard"


def loss_head(shape: ModelShape, s: RunSettings, device: Device, c: StepContext, states: ModelStates) -> Loss:
    """The loss head's terms: the standard loss's logits and their fp32 copies, or the fused linear cross-entropy's
    rule (decoder-only models: an encoder-decoder trains with the standard loss), which holds no logits."""
    fused = s.fused_loss and not shape.encoder_layers
    kernel = loss_kernel_of(s, device) if fused else "standard"
    logits = c.logit_bytes * c.tokens * shape.vocab
    kept_logits = logits if s.keep_logits and not fused else 0
    head_copy = (c.dtype_bytes * shape.vocab * shape.hidden
                 if (s.master_weights or (s.kbit and s.amp and not s.frozen_16bit)) and not c.fsdp_mp else 0)
    if fused:
        peak = _fused_loss_peak(shape, c, kernel, states)
    else:
        peak = max(_standard_loss(shape, c, logits, kept_logits))
    return Loss(kernel=kernel, logits=logits, kept_logits=kept_logits, peak=peak, head_copy=head_copy)


def _standard_loss(shape: ModelShape, c: StepContext, logits: int, kept_logits: int) -> tuple[int, int]:
    """(forward, backward) of the standard loss. Forward: the logits, their fp32 copy (a no-op when already fp32),
    the log_softmax output. Backward: the saved log_softmax output plus two fp32 grads (of it, and of its input);
    the logits themselves are still alive only when the loop keeps the model output (an output dropped after
    ``.loss`` frees them, since neither the cast nor log_softmax saves its input)."""
    tv, lb = c.tokens * shape.vocab, c.logit_bytes
    if shape.arch.loss_on_16bit_logits and c.gpu_amp and lb != 4:
        # cross_entropy of 16-bit logits (no upcast first): a GPU's autocast runs log_softmax in 16 bits and copies
        # its output to fp32 for nll_loss, which keeps that copy; nll_loss's backward adds its fp32 grad (CPU
        # autocast: an fp32 log_softmax, as below)
        return logits + (lb + 4) * tv, kept_logits + (lb + 8) * tv
    return logits + (4 * tv if lb != 4 else 0) + 4 * tv, kept_logits + 12 * tv


def _fused_loss_peak(shape: ModelShape, c: StepContext, kernel: str, states: ModelStates) -> int:
    """The fused linear cross-entropy's peak by its kernel's rule (fitburst.memory.loss_kernels), with the cast of
    fp32 hidden states (a k-bit model's stream under autocast, autocast's fp32 LayerNorm output) to the matmul dtype
    fitburst makes first; a full fine-tune's copy is the head input's ``nf``, as for the standard head. On top of
    the activations, whose head input (a trained head's) stands for the hidden states given to the kernel: the
    rule's peak takes them off where the library frees them before its backward (``released``)."""
    h, lb = shape.hidden, c.logit_bytes
    terms = fused_loss_terms(kernel, c.tokens, h, shape.vocab, lb, head_grad=c.full,
                             head_bytes=states.value_bytes if c.full else None, softcap=shape.softcap)
    hidden_b = 4 if (c.act_bytes == 4 or c.norm32) and not c.full else lb
    return terms.plus(hidden_cast(kernel, c.tokens, h, lb, hidden_b)).peak


Phases = dict[str, dict[str, int]]  # each phase of the step (in the order they run) by component


# --- the phases ------------------------------------------------------------------------------------------------


def _components(states: ModelStates, grads: int, optimizer: int, acts: int, loss: int,
                transient: int) -> dict[str, int]:
    """One phase's figure by component: the weights as stored, then what the phase holds of the rest."""
    out = dict(states.weights)
    out.update({"lora_weights": states.adapters, "gradients": grads, "optimizer_states": optimizer,
                "activations": acts, "logits_loss": loss, "transient": transient})
    return out


def _accumulated(s: RunSettings, states: ModelStates) -> int:
    """Gradients of earlier micro-steps, held while accumulating."""
    return states.gradients if s.grad_accum > 1 else 0


def forward_phase(shape: ModelShape, s: RunSettings, c: StepContext, states: ModelStates,
                  acts: Activations) -> dict[str, int]:
    """The forward's end: everything saved, the last block's transient and bitsandbytes' dequantized weight (the
    largest, in the compute dtype, with its input and output casts); a checkpointed block with the flash kernel
    peaks in its attention where that holds more than its MLP (a tiled one), before the head's input exists."""
    dequant = 2 * shape.largest_linear() if s.kbit else 0
    transient = forward_transient(shape, c, kbit_casts=s.kbit)
    if s.gradient_checkpointing and c.attention == "flash":  # the last block's attention, before the head's input
        transient = max(transient, attention_forward_transient(shape, c) - acts.head_input)
    return _components(states, _accumulated(s, states), states.optimizer, acts.at_forward_end, 0,
                       transient + dequant)


def vision_phase(s: RunSettings, states: ModelStates, acts: Activations) -> dict[str, int]:
    """The vision tower's forward: it runs first, before the language model keeps anything."""
    return _components(states, _accumulated(s, states), states.optimizer, acts.shared + acts.vision_saved, 0,
                       acts.vision_forward)


def loss_phase(s: RunSettings, states: ModelStates, acts: Activations, head: Loss) -> dict[str, int]:
    return _components(states, _accumulated(s, states), states.optimizer, acts.at_loss, head.peak,
                       head.head_copy)


def backward_phase(shape: ModelShape, s: RunSettings, c: StepContext, states: ModelStates, acts: Activations,
                   head: Loss) -> dict[str, int]:
    """The backward's peak, block by block from the top (:func:`_blocks_backward`), or (a full fine-tune) when the
    embedding's dense gradient arrives last."""
    held, grads, transient = _blocks_backward(shape, s, c, states, acts, head)
    if c.full:
        # the eager mask is gone by then (below); a sharded run's embedding gradient is in fsdp_buffers
        shared = _shared_in_backward(s, c, acts)
        emb_g = states.value_bytes * shape.vocab * shape.hidden if s.world_size == 1 else 0
        tied = emb_g if shape.tied else 0
        if shared + grads[1] + emb_g + head.kept_logits > held + grads[0] + transient:
            held, grads, transient = shared, (grads[1] + emb_g - tied, 0), head.kept_logits + tied
    grad_bytes = grads[0] if c.full else max(grads[0], _accumulated(s, states))
    return _components(states, grad_bytes, states.optimizer, held, 0, transient)


def _shared_in_backward(s: RunSettings, c: StepContext, acts: Activations) -> int:
    """Eager attention's float mask is read by additions only: freed after the forward unless checkpointing keeps it
    as a block input."""
    return acts.shared - (acts.mask if c.attention == "eager" and not s.gradient_checkpointing else 0)


def _blocks_backward(shape: ModelShape, s: RunSettings, c: StepContext, states: ModelStates, acts: Activations,
                     head: Loss) -> tuple[int, tuple[int, int], int]:
    """(activations, (gradients, gradients once every block is done), transient) at the blocks' backward peak. Each
    block's MLP backward runs with all of the block's saved tensors, the attention's after it freed the MLP's; an
    offloaded block's tensors are copied back for its backward. A full fine-tune's gradients grow block by block."""
    head_grad = states.value_bytes * shape.vocab * shape.hidden if c.full else 0
    grads = _accumulated(s, states) + head_grad
    # offloaded: only the current block's tensors are back
    remaining = (0 if acts.offloaded else acts.blocks_on_device) + _shared_in_backward(s, c, acts) + \
        acts.adapter_copies + acts.vision_saved + acts.embed_leaf + acts.leaf_input
    n = len(acts.per_block)
    block_params = (states.trained - embed_head_params(shape)) / max(n, 1) if c.full else 0
    mlp_t, att_t = block_backward_transient(shape, c)
    ln2, norm_t = norm_backward(shape, c)
    dequant = 2 * shape.largest_linear() if s.kbit else 0  # bnb's dequantized weight (and its grad input's cast)
    beside = dequant + head.kept_logits + c.dtype_bytes * c.tokens * shape.hidden  # the stream's gradient
    best = (0, 0, 0)
    for i in range(n - 1, -1, -1):
        back = acts.kept[i] if acts.offloaded else 0
        with_mlp = remaining + back + acts.recomputed[i]
        below = with_mlp - acts.top_sublayer[i]
        for held, transient in ((with_mlp, mlp_t), (below + ln2, norm_t), (below, att_t)):
            if held + transient + beside + grads > sum(best):
                best = (held, grads, transient + beside)
        if not acts.offloaded:
            remaining -= acts.kept[i]
        if c.full:
            grads += int(block_params * states.value_bytes)
    return best[0], (best[1], grads), best[2]


def norm_backward(shape: ModelShape, c: StepContext) -> tuple[int, int]:
    """(what the MLP's norm keeps, its backward's transient) between the MLP's backward and the attention's, in a
    decoder block with Llama's RMSNorm (0, 0 elsewhere: the other candidates cover them): the norm keeps its fp32
    input; its backward, in fp32 Python ops, holds four fp32 tensors of the block's width at once (pow's and mean's
    backward, the products with the weight and with rsqrt) beside its input's gradient in the stream's dtype. The
    peak of a block's backward where the MLP is tiled (its own backward then holds one shard)."""
    if shape.arch.block != "decoder" or shape.norm_style != "llama" or shape.parallel_block or c.full:
        return 0, 0
    th = c.tokens * shape.hidden
    return 4 * th, (16 + c.act_bytes) * th


def optimizer_phase(states: ModelStates, head: Loss) -> dict[str, int]:
    """The optimizer step: every gradient, the state, the step's temporaries; the logits the loop still holds."""
    return _components(states, states.gradients, states.optimizer, 0, head.kept_logits, states.optimizer_temp)


def eval_phase(shape: ModelShape, s: RunSettings, c: StepContext, states: ModelStates,
               head: Loss) -> dict[str, int]:
    """fitburst.evaluate's step (a fresh load: no gradients, no optimizer state, the input embeddings on the GPU
    even where training kept them in host RAM): it takes the loss in chunks, an fp32 copy and log_softmax of one
    chunk only, beside the eval batch's logits (or the fused kernel's eval)."""
    tokens = s.eval_batch * s.seq_len
    chunk = min(tokens, EVAL_CHUNK_TOKENS)
    h, vocab, lb = shape.hidden, shape.vocab, c.logit_bytes
    if head.fused:
        loss_bytes = fused_eval_bytes(head.kernel, chunk, h, vocab, lb, head_grad=c.full,
                                      head_bytes=states.value_bytes if c.full else None, softcap=shape.softcap)
    else:
        loss_bytes = lb * tokens * vocab + 8 * chunk * vocab
    out = _components(states, 0, 0, 0, loss_bytes + 4 * c.act_bytes * tokens * max(h, shape.intermediate), 0)
    out.update({k: out[k] + n for k, n in states.host_embeddings.items()})
    return out


def step_phases(shape: ModelShape, s: RunSettings, c: StepContext, states: ModelStates, acts: Activations,
                head: Loss) -> Phases:
    """Every phase of the step by component, in the order they run."""
    phases = {"forward": forward_phase(shape, s, c, states, acts)}
    if acts.vision_forward:
        phases["vision"] = vision_phase(s, states, acts)
    phases["loss"] = loss_phase(s, states, acts, head)
    phases["backward"] = backward_phase(shape, s, c, states, acts, head)
    phases["optimizer_step"] = optimizer_phase(states, head)
    if s.eval_batch:
        phases["eval"] = eval_phase(shape, s, c, states, head)
    return phases


def per_rank_phases(shape: ModelShape, s: RunSettings, phases: Phases) -> Phases:
    """Each phase on one rank of an FSDP run: model states sharded, FSDP's gathered weights and gradient buffers."""
    buffers = fsdp_buffers(shape, s)
    replicated = weight_bytes(shape, s).get("weights_quantized", 0) - packed_4bit(shape, s)
    return {k: per_rank(v, s.world_size, replicated, buffers[k], k == "optimizer_step", s.cpu_offload)
            for k, v in phases.items()}


# --- the estimate ------------------------------------------------------------------------------------------------


def estimate(shape: ModelShape, settings: RunSettings, device: Device, calibrate: bool = True) -> Estimate:
    """The analytic estimate of one training step of ``settings`` on ``device``; whether it fits is judged by
    :class:`fitburst.memory.budget.Budget`. No estimate of int8 weights sharded by FSDP (a row of the rule table,
    :mod:`fitburst.rules`: they cannot be, so nothing models their shards): a ValueError."""
    s = settings
    if any(p.rule == "fsdp_int8" for p in problems(s)):
        raise ValueError("int8 weights cannot be sharded by FSDP (use nf4, or distributed none)")
    c = step_context(shape, s, device)
    notes: list[str] = [expanded_kv_note(device)] if c.kv_expanded else []
    states = model_states(shape, s, device)
    if states.paged:
        notes.append(f"paged optimizer state ({states.paged / GiB:.2f} GiB) lives in CUDA unified memory, outside "
                     "torch's allocator; it pages to host RAM under pressure")
    acts = saved_activations(shape, s, device, c, states.trained)
    head = loss_head(shape, s, device, c, states)
    if head.fused:
        notes.append(f"loss: {describe_lean(s, device)}")
    phases = step_phases(shape, s, c, states, acts, head)
    if s.world_size > 1:
        phases = per_rank_phases(shape, s, phases)
        notes.append(f"FSDP over {s.world_size} GPUs: per-GPU figures (model states / {s.world_size}, activations of "
                     "this GPU's micro-batch, gathered blocks and gradient buffers)")
    est = _summed(shape, s, device, phases, 0 if head.fused else c.tokens, notes, calibrate)
    est.offloaded_host_bytes = acts.offloaded_bytes + (offloaded_loss(shape, c, head) if acts.offloaded else 0)
    return est


def offloaded_loss(shape: ModelShape, c: StepContext, head: Loss) -> int:
    """What the loss saves for backward under activation offloading, which the loop runs inside the offloading
    context (TRL leaves only the output head's own forward on the device): the fused kernel's hidden states in the
    matmul dtype; the standard loss's fp32 log-softmax output and, from 16-bit logits, their fp32 copy."""
    if head.fused:
        return c.logit_bytes * c.tokens * shape.hidden
    return (4 if c.logit_bytes == 4 else 8) * c.tokens * shape.vocab


def _summed(shape: ModelShape, s: RunSettings, device: Device, phases: Phases,
            logit_tokens: int, notes: list[str], calibrate: bool) -> Estimate:
    """The estimate of these phases: the largest is the peak; reserved from it by the allocator's rule (CUDA: and
    the standard loss's fp32 logits of the micro-batch's ``logit_tokens``; 0 for a fused loss, which makes none),
    calibrated where `fitburst calibrate` fitted a factor."""
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak_phase = max(totals, key=lambda k: totals[k])
    alloc = totals[peak_phase]
    logits = 4 * logit_tokens * shape.vocab
    reserved = int(alloc * RESERVED_FACTOR[device.kind] + RESERVED_PER_LOGITS[device.kind] * logits) + RESERVED_FLOOR[
        device.kind]
    factor, fitted_on = calibration.factor_for(device.name, device.kind) if calibrate else (1.0, "")
    rfactor = calibration.reserved_factor_for(device.name, device.kind) if calibrate else 1.0
    if factor != 1.0 or rfactor != 1.0:  # fitted by `fitburst calibrate` on measured runs; components as modelled
        alloc, reserved = int(alloc * factor), int(reserved * rfactor)
        notes.append(f"calibrated: allocated x{factor:.3f}, reserved x{rfactor:.3f} (fitted on {fitted_on})")
    notes += _device_notes(shape, s, device)
    return Estimate(
        allocated_peak_bytes=int(alloc),
        reserved_peak_bytes=reserved,
        device_total_bytes=reserved + device.outside_allocator,
        components={k: int(v) for k, v in phases[peak_phase].items() if v},
        peak_phase=peak_phase,
        device=device.name,
        budget_bytes=device.budget_bytes,
        params=param_counts(shape, s),
        phases={k: int(v) for k, v in totals.items()},
        settings=asdict(s),
        model=shape.name,
        notes=notes,
        calibration_factor=factor,
        reserved_calibration_factor=rfactor,
        world_size=s.world_size,
        vocab=shape.vocab,
    )


def _device_notes(shape: ModelShape, s: RunSettings, device: Device) -> list[str]:
    """What the shape and the device say beside the figures."""
    notes = [shape.extra_note] if shape.extra_note else []
    if s.precision == "bf16" and not device.supports_bf16:
        notes.append(f"{device.name} has no bf16: use fp16 (same memory, but bf16 would be emulated)")
    if s.kbit and not device.supports_bnb:
        notes.append(f"bitsandbytes quantization is not available on {device.name}")
    return notes
