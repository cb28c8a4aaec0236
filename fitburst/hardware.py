"""Hardware facts, the bottom layer every other module may import: devices and their memory budgets (named GPUs,
Apple parts, ``kind:SIZE`` strings, or this machine as probed), the cloud providers' names for each GPU, and which
SDPA kernel a CUDA device runs. Pure Python: importing it never imports torch (probing a GPU does, at call time).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, replace

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # cuda | mps | cpu
    total_bytes: int  # what the runtime reports as the device's memory
    budget_bytes: int  # what one run may use: total minus context / OS reserve
    supports_bf16: bool = True
    supports_bnb: bool = True  # bitsandbytes 4/8-bit usable
    context_bytes: int = 0  # CUDA context / runtime overhead outside the allocator, once CUDA is initialised
    hourly_hint: str = ""
    capability: tuple[int, int] | None = None  # CUDA compute capability (None: no CUDA GPU, or not known)
    runtime_bytes: int = 0  # CUDA: what training adds outside the allocator after initialisation (CUDA_RUNTIME)
    # the run trains on this machine (probed, the preflight's device, the loop's): the libraries installed here decide
    # what can run on it. False: a planned target (a rented GPU, a device named to ``fitburst estimate``), whose node
    # installs fitburst's lean extra itself (fitburst.hardware.NODE_PACKAGES)
    local: bool = False

    @property
    def outside_allocator(self) -> int:
        """Device memory a training process holds outside torch's allocator: the context and CUDA's runtime."""
        return self.context_bytes + self.runtime_bytes

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# name: (total MiB as torch reports it, context MiB once CUDA is initialised, compute capability)
# totals are torch.cuda.mem_get_info()[1] on those cards. Measured: T4 (141 MiB context, stack notes), H100 80GB HBM3
# (81079 MiB, 527 MiB context: benchmarks/results/gpu_check-NVIDIA_H100_80GB_HBM3-run*.csv, torch 2.11 + CUDA 13.0);
# the others are the usual figures for torch 2.x. bf16 (and FlashAttention-2) from sm 8.0 on.
_NAMED: dict[str, tuple[int, int, tuple[int, int]]] = {
    "T4": (14912, 141, (7, 5)),
    "V100-16GB": (16151, 300, (7, 0)),
    "V100-32GB": (32501, 300, (7, 0)),
    "L4": (22491, 300, (8, 9)),
    "A10G": (22491, 300, (8, 6)),
    "A10": (22491, 300, (8, 6)),
    "RTX3090": (24253, 300, (8, 6)),
    "RTX4090": (24210, 300, (8, 9)),
    "RTX5090": (32111, 350, (12, 0)),
    "A4000": (16101, 300, (8, 6)),
    "A5000": (24248, 300, (8, 6)),
    "A6000": (48670, 300, (8, 6)),
    "L40S": (45488, 350, (8, 9)),
    "A40": (45488, 300, (8, 6)),
    "A100-40GB": (40339, 400, (8, 0)),
    "A100-80GB": (81038, 400, (8, 0)),
    "H100": (81079, 527, (9, 0)),
    "H100-80GB": (81079, 527, (9, 0)),
    "H200": (143166, 527, (9, 0)),
}
# Device memory a training process adds outside the caching allocator after CUDA's initialisation: kernel modules
# loaded lazily at first use, the cuBLAS / cuBLASLt / cuDNN handles. Measured once, on an H100 80GB HBM3 (torch 2.11,
# CUDA 13.0, driver 580): 527 MiB outside the allocator after loading, 619 after peft built the adapters, 767 from
# the first step on, the same in 9 of the 10 configurations of benchmarks/gpu_check.py (224 MiB in fp32); taken
# for every CUDA card.
CUDA_RUNTIME = 240 * MiB
# Apple silicon: unified memory; MPS may use torch.mps.recommended_max_memory() (~75 % of RAM above 32 GB,
# ~66 % below); bitsandbytes has no MPS backend, so no QLoRA there.
_APPLE = {
    "M1-16GB": 16,
    "M2-16GB": 16,
    "M3-18GB": 18,
    "M1-Pro-32GB": 32,
    "M2-Pro-32GB": 32,
    "M3-Pro-36GB": 36,
    "M1-Max-32GB": 32,
    "M1-Max-64GB": 64,
    "M2-Max-32GB": 32,
    "M2-Max-64GB": 64,
    "M2-Max-96GB": 96,
    "M3-Max-36GB": 36,
    "M3-Max-48GB": 48,
    "M3-Max-64GB": 64,
    "M3-Max-128GB": 128,
    "M4-Max-36GB": 36,
    "M4-Max-64GB": 64,
    "M4-Max-128GB": 128,
    "M2-Ultra-192GB": 192,
}
ALIASES = {
    "RTX-3090": "RTX3090",
    "RTX-4090": "RTX4090",
    "3090": "RTX3090",
    "4090": "RTX4090",
    "RTXA6000": "A6000",
    "RTX-A6000": "A6000",
    "A100": "A100-80GB",
    "A100-40G": "A100-40GB",
    "A100-80G": "A100-80GB",
    "H100-SXM": "H100",
    "H100-PCIE": "H100",
}
CPU_RESERVE = 2 * GiB  # OS + python + torch runtime outside tensors
FREE_WARN = 0.05  # free memory this far below the CPU budget is worth a warning
CPU_CONTEXT = 600 * MiB  # torch + transformers imported, measured RSS before the model


def auto_precision(kind: str, supports_bf16: bool) -> str:
    """What ``precision: auto`` trains in: bf16 where the device has it (fp16 on CUDA cards without, e.g. T4;
    bf16 on MPS), fp32 on CPU. The train step and the estimate both use this rule."""
    if kind == "cpu":
        return "fp32"
    return "bf16" if supports_bf16 or kind == "mps" else "fp16"


def known_devices() -> list[str]:
    return sorted(_NAMED) + sorted(_APPLE)


def _apple_budget(ram_gib: float) -> int:
    frac = 0.75 if ram_gib > 32 else 2 / 3
    return int(ram_gib * GiB * frac)


_SIZE = re.compile(r"^(cuda|gpu|mps|cpu):\s*([0-9.]+)\s*(gib|gb|mib|mb|g|m)?$", re.I)


def cuda_gpu(name: str, total: int, context: int, capability: tuple[int, int] | None) -> Device:
    """A CUDA GPU: its budget is what the allocator may reserve, the total less the context and CUDA_RUNTIME. An
    unknown capability (``cuda:24GiB``) is taken to have bf16."""
    bf16 = capability is None or capability >= (8, 0)
    return Device(name, "cuda", total, total - context - CUDA_RUNTIME, bf16, True, context, capability=capability,
                  runtime_bytes=CUDA_RUNTIME)


def _parse_size(num: str, unit: str | None) -> int:
    unit = (unit or "gib").lower()
    mult = {"gib": GiB, "g": GiB, "gb": 10**9, "mib": MiB, "m": MiB, "mb": 10**6}[unit]
    return int(float(num) * mult)


def resolve_device(name: str = "auto") -> Device:
    """A named device, a ``kind:SIZE`` string (the size is the device's memory: for mps the budget MPS gets),
    or ``auto`` / ``cuda`` / ``mps`` / ``cpu`` to probe this machine. Several GPUs (``RTX4090 x2``, ``cuda:0,1``,
    :func:`resolve_gpus`): one of them."""
    raw = split_count(name or "auto")[0] or "auto"
    if idx := _INDICES.match(raw.replace(" ", "")):
        return probe_local("cuda", [int(i) for i in idx.group(1).split(",")])
    key = raw.upper().replace(" ", "")
    key = ALIASES.get(key, key)
    if key in _NAMED:
        tot, ctx, cap = _NAMED[key]
        return cuda_gpu(key, tot * MiB, ctx * MiB, cap)
    for apple, ram in _APPLE.items():
        if key == apple.upper():
            return Device(apple, "mps", ram * GiB, _apple_budget(ram), True, False, 0)
    m = _SIZE.match(raw)
    if m:
        kind = "cuda" if m.group(1).lower() in ("cuda", "gpu") else m.group(1).lower()
        size = _parse_size(m.group(2), m.group(3))
        if kind == "cuda":
            return cuda_gpu(raw, size, 300 * MiB, None)
        if kind == "mps":
            return Device(raw, "mps", size, size, True, False, 0)
        return Device(raw, "cpu", size, max(size - CPU_RESERVE, size // 2), True, True, CPU_CONTEXT)
    low = raw.lower()
    if low in ("auto", "local", "cuda", "mps", "cpu"):
        return probe_local(low)
    raise ValueError(
        f"unknown device {raw!r}: use auto, cuda, mps, cpu, cuda:24GiB / mps:36GiB / cpu:64GiB, "
        f"or one of {', '.join(known_devices())} (several GPUs: RTX4090 x2, cuda:24GiB x2, cuda:0,1)"
    )


# --- several GPUs -------------------------------------------------------------------------------------------
# ``preflight.device`` names one device as above, or several GPUs of one kind on this machine: ``<device> xN``
# (``RTX4090 x2``, ``cuda:24GiB x2``, also ``2x RTX4090``), ``cuda:0,1`` (those visible GPUs, probed), ``auto`` /
# ``cuda`` (every visible CUDA GPU). MPS is one device; ``cpu xN`` is N processes sharing this CPU's memory (gloo).

_TIMES = re.compile(r"^(?:(?P<n1>\d+)\s*[x×]\s+(?P<d1>\S.*)|(?P<d2>.*\S)\s+[x×]\s*(?P<n2>\d+))$", re.I)
_INDICES = re.compile(r"^cuda:(\d+(?:,\d+)+)$", re.I)  # cuda:0,1 (one GPU: CUDA_VISIBLE_DEVICES; cuda:1 is 1 GiB)


@dataclass(frozen=True)
class Gpus:
    """The GPUs a run may use: ``count`` of one kind per node on ``nodes`` nodes. ``device`` is one GPU (its memory
    and budget: a sharded run is planned per GPU); ``host_bytes``: each node's RAM, where known."""

    device: Device
    count: int = 1
    nodes: int = 1
    host_bytes: int | None = None

    @property
    def world_size(self) -> int:
        return self.count * self.nodes

    def label(self) -> str:
        one = self.device.name if self.count == 1 else f"{self.count}x {self.device.name}"
        return one if self.nodes == 1 else f"{self.nodes} nodes x {one}"


def split_count(name: str) -> tuple[str, int | None]:
    """``RTX4090 x2`` / ``2x RTX4090`` -> (``RTX4090``, 2); a name without a count -> (name, None)."""
    m = _TIMES.match((name or "").strip())
    if not m:
        return (name or "").strip(), None
    return (m["d1"] or m["d2"]).strip(), int(m["n1"] or m["n2"])


def check_gpus(name: str) -> None:
    """Refuse a ``preflight.device`` that cannot name this machine's devices, without probing (ValueError)."""
    raw, n = split_count(name)
    if _INDICES.match(raw.replace(" ", "")):
        if n is not None:
            raise ValueError(f"{name!r}: cuda:0,1 already names the GPUs; drop the count")
        return
    if n is not None and n < 1:
        raise ValueError(f"{name!r}: the count must be 1 or more")
    low = raw.lower()
    if low in ("auto", "local", "cuda"):
        if n is not None:
            raise ValueError(f"{name!r}: {low} uses every visible CUDA GPU; to use fewer, name them (cuda:0,1) or "
                             "a GPU and its count (RTX4090 x2)")
        return
    if low in ("cpu", "mps"):
        kind = low
    else:
        kind = resolve_device(raw).kind  # a ValueError here lists the known names
    if kind == "mps" and n not in (None, 1):
        raise ValueError(f"{name!r}: MPS is one device (several devices train together on CUDA GPUs, or as CPU "
                         "processes: cpu x2): drop the count")


def named_device(name: str) -> Device | None:
    """The device ``preflight.device`` names without probing this machine (one GPU of several), or None where only a
    probe can tell (auto, cuda, mps, cpu, cuda:0,1)."""
    raw = split_count(name)[0]
    if raw.lower() in ("auto", "local", "cuda", "mps", "cpu") or _INDICES.match(raw.replace(" ", "")):
        return None
    return resolve_device(raw)


def resolve_gpus(name: str = "auto") -> Gpus:
    """The GPUs ``name`` stands for (:func:`check_gpus`'s forms): a named or sized device and its count, the listed
    visible CUDA GPUs, or every visible one (``auto``, ``cuda``: probed; CPU or MPS when there is none). Several
    GPUs of different memory are planned as the smallest. The host RAM is this machine's (a preflight runs on the
    machine it plans for)."""
    check_gpus(name)
    raw, n = split_count(name)
    host = host_ram_bytes()
    if idx := _INDICES.match(raw.replace(" ", "")):
        return Gpus(resolve_device(raw), len(idx.group(1).split(",")), 1, host)
    if raw.lower() in ("auto", "local", "cuda"):
        dev = probe_local(raw.lower())
        return Gpus(dev, _cuda_count() if dev.kind == "cuda" else 1, 1, host)
    dev = replace(resolve_device(raw), local=True)  # named or sized: this machine's, as the preflight names it
    if dev.kind == "cpu" and n:  # N processes on this CPU (gloo): each has its share of the memory
        dev = Device(f"{dev.name} / {n}", "cpu", dev.total_bytes // n, dev.budget_bytes // n, dev.supports_bf16,
                     dev.supports_bnb, dev.context_bytes, local=True)
    return Gpus(dev, n or 1, 1, host)


def _cuda_count() -> int:
    import torch  # only when a CUDA device was probed

    return torch.cuda.device_count()


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (a container's size), None when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            txt = open(path).read().strip()
        except OSError:
            continue
        if txt.isdigit() and int(txt) < (1 << 60):
            return int(txt)
    return None


def _meminfo() -> tuple[int, int]:
    total = avail = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            avail = total // 2
        except (ValueError, OSError, AttributeError):
            total, avail = 16 * GiB, 8 * GiB
    return total, avail


def _cpu_device() -> Device:
    """This machine as a CPU device. The budget is a stable figure, the machine's memory (or its container's
    limit) less CPU_RESERVE, so two preflights a minute apart plan alike; when less than that is free right now,
    a warning says so (5 % below it or more; the run may swap or be killed unless something is closed first)."""
    total, avail = _meminfo()
    cg = _cgroup_limit()
    if cg is not None:
        total = min(total, cg)
    budget = max(total - CPU_RESERVE, total // 2)
    if avail < budget * (1 - FREE_WARN):
        _warn_once("cpu-free", f"this machine has {total / GiB:.1f} GiB; the CPU budget is {budget / GiB:.1f} GiB "
                   f"(all of it less {CPU_RESERVE / GiB:.0f} GiB for the system), but only {avail / GiB:.1f} GiB is "
                   "free now: close other programs if the run needs more than that")
    # whether QLoRA is possible here: installed is enough (importing it costs seconds and loads its kernels)
    bnb = importlib.util.find_spec("bitsandbytes") is not None
    return Device("cpu (local)", "cpu", total, budget, True, bnb, CPU_CONTEXT, local=True)


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """One warning per process for ``key`` (a run probes the device from several steps)."""
    if key not in _WARNED:
        _WARNED.add(key)
        logging.getLogger(__name__).warning("%s", message)


def _apple_chip() -> str:
    """The Mac's chip as macOS names it ("Apple M2 Max"), for throughput tables; "local" when unknown."""
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "local"


# --- the fused linear cross-entropy a device runs -----------------------------------------------------------
# The loop (fitburst.families.loss) and the estimates (fitburst.memory.loss_kernels) both decide on these facts.
FUSED_KERNELS = ("cce", "liger", "cce_compile", "chunked")
FUSED_MODULES = {"cce": "cut_cross_entropy", "cce_compile": "cut_cross_entropy", "liger": "liger_kernel"}


@functools.cache
def cpu_compiler() -> bool:
    """Whether inductor's CPU backend (what CCE's torch_compile path compiles with) finds a C++ compiler here."""
    import shutil

    return any(shutil.which(c) for c in (os.environ.get("CXX") or "g++", "c++", "clang++"))


def fused_loss_kernel(device: Device, dtype: str) -> tuple[str, str]:
    """The fused linear cross-entropy that runs on ``device`` for a run computing in ``dtype``, and why: Cut
    Cross-Entropy's Triton kernel on an Ampere or newer card (bf16 marks them) in 16 bits (its backward takes 16-bit
    hidden states only); Liger Kernel's Triton kernel on older cards (a T4, a V100) or in fp32; on CPU and MPS,
    CCE's ``torch_compile`` implementation (inductor: C++ on the CPU, Metal on MPS). A hand-written chunked loss only
    on a CPU where inductor finds no C++ compiler."""
    if device.kind == "cuda":
        if device.supports_bf16 and dtype != "fp32":
            return "cce", f"{device.name}: Cut Cross-Entropy's Triton kernel (Ampere or newer, 16-bit)"
        why = "Ampere or newer is CCE's" if not device.supports_bf16 else "CCE's backward takes 16-bit inputs only"
        return "liger", f"{device.name}: Liger Kernel's fused linear cross-entropy (Triton; {why})"
    if device.kind == "cpu" and not cpu_compiler():
        return "chunked", ("no C++ compiler for inductor here, so CCE's torch_compile path cannot run: fitburst's "
                           "own chunked linear cross-entropy (1024 tokens of logits at a time, recomputed in "
                           "backward)")
    return "cce_compile", (f"{device.name}: Cut Cross-Entropy's torch_compile implementation (no Triton on "
                           f"{device.kind})")


def fused_loss_missing(device: Device, dtype: str) -> str | None:
    """Why the fused loss ``device`` runs (:func:`fused_loss_kernel`) cannot run where a run on it trains (its
    library, :func:`library_missing`), or None when it can."""
    module = FUSED_MODULES.get(fused_loss_kernel(device, dtype)[0])
    return library_missing(module, device) if module is not None else None


# --- what a run's machine has installed ------------------------------------------------------------------------
# What a burst node pip-installs (fitburst.cloud.task pins each to the launcher's version): the lean extra's
# libraries among them, as a rented GPU runs the plan's kernels whatever the launcher has.
NODE_PACKAGES = ["torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "tokenizers", "pydantic",
                 "pyyaml", "rich", "mlflow",
                 # the lean extra: the fused losses, Liger's kernels, the tiled MLP, activation offloading (CUDA)
                 "liger-kernel", "cut-cross-entropy", "trl"]
LIBRARIES = {"cut_cross_entropy": "cut-cross-entropy", "liger_kernel": "liger-kernel", "trl": "trl",
             "flash_attn": "flash-attn"}  # import name: pip name


def library_missing_here(module: str) -> str | None:
    """Why ``module`` (a key of :data:`LIBRARIES`) cannot be imported on this machine, or None when it can."""
    return None if importlib.util.find_spec(module) is not None else f"{LIBRARIES[module]} is not installed here"


def library_missing(module: str, device: Device | None, here: Callable[[], str | None] | None = None) -> str | None:
    """Why ``module`` (a key of :data:`LIBRARIES`) cannot be imported where a run on ``device`` trains, or None
    when it can: this install decides for a run that trains here (``device.local``) and for a planned MPS or CPU
    device (another such machine's install is not known); a planned CUDA target is a burst node, which installs
    :data:`NODE_PACKAGES`. None too where the device is not known. ``here``: this install's probe, where one says
    more than :func:`library_missing_here`."""
    if device is None:
        return None
    if device.local or device.kind != "cuda":
        return here() if here is not None else library_missing_here(module)
    return None if LIBRARIES[module] in NODE_PACKAGES else f"a burst node does not install {LIBRARIES[module]}"


def available_host_bytes() -> int | None:
    """Memory the OS can give this node now (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_ram_bytes() -> int:
    """This machine's RAM (or its container's limit)."""
    total, _ = _meminfo()
    cg = _cgroup_limit()
    return min(total, cg) if cg is not None else total


def _cuda_devices(indices: list[int]) -> list[Device]:
    """The CUDA GPUs ``indices``, read in a child process. Reading a GPU's free memory opens a CUDA context on it
    (about 0.5 GiB on an H100) that lasts as long as the process: the process that plans a run over several GPUs
    starts ranks on them and trains on none, and a context of its own there would be memory the plan never
    counted. The child's context stands in the reading for the one the training process will open."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(_read_cuda_devices, indices).result()


def _read_cuda_devices(indices: list[int]) -> list[Device]:
    import torch

    return [_cuda_device(torch, i) for i in indices]


def _cuda_device(torch, index: int) -> Device:
    free, total = torch.cuda.mem_get_info(index)
    props = torch.cuda.get_device_properties(index)
    used_by_others = total - free  # the reading process's context, and whatever other processes hold
    ctx = max(used_by_others, 141 * MiB)
    cap = tuple(torch.cuda.get_device_capability(index))
    return replace(cuda_gpu(f"cuda ({props.name})", total, min(ctx, 600 * MiB), (cap[0], cap[1])),
                   budget_bytes=total - ctx - CUDA_RUNTIME, local=True)


def probe_local(want: str = "auto", indices: list[int] | None = None) -> Device:
    """Probe this machine; torch is imported lazily and only when a GPU may be there. With several visible CUDA
    GPUs (or the ``indices`` asked for), the one with the smallest budget: a run sharded over them is planned for
    it."""
    if want in ("auto", "local", "cuda", "mps"):
        try:
            import torch  # torch: heavy and optional here; only a probe for a GPU needs it
        except ImportError:
            torch = None  # type: ignore[assignment]
        if torch is not None and want in ("auto", "local", "cuda") and torch.cuda.is_available():
            n = torch.cuda.device_count()
            missing = [i for i in indices or [] if not 0 <= i < n]
            if missing:
                raise ValueError(f"no CUDA GPU {missing[0]} here: this machine shows {n} (cuda:0..{n - 1}; "
                                 "CUDA_VISIBLE_DEVICES decides which are visible)")
            return min(_cuda_devices(indices if indices is not None else list(range(n))), key=lambda d: d.budget_bytes)
        mps = getattr(torch, "backends", None) and torch.backends.mps.is_available() if torch else False
        if mps and want in ("auto", "local", "mps"):
            rec = int(torch.mps.recommended_max_memory())
            total, _ = _meminfo()
            return Device(f"mps ({_apple_chip()})", "mps", total, rec, True, False, 0, local=True)
        if want in ("cuda", "mps") or indices:
            raise ValueError(f"no {want} device on this machine (use a named device such as RTX4090)")
    return _cpu_device()


# --- cloud GPUs -----------------------------------------------------------------------------------------
# fitburst names a GPU as the table above does (``A6000``, ``T4``, ``A100-80GB``); each provider may call it
# differently in SkyPilot's catalog (RunPod ``RTXA6000``, Lambda ``A6000``).

# provider key (BurstSpec.providers) -> SkyPilot cloud name (InstanceTypeInfo.cloud / `infra:`)
SKY_CLOUD = {"runpod": "RunPod", "lambda": "Lambda", "aws": "AWS", "gcp": "GCP", "azure": "Azure"}

# fitburst GPU name -> {provider: SkyPilot catalog accelerator name}. Absent provider = not offered.
SKY_NAMES: dict[str, dict[str, str]] = {
    "T4": {"aws": "T4", "gcp": "T4", "azure": "T4"},
    "L4": {"runpod": "L4", "aws": "L4", "gcp": "L4"},
    "A10G": {"aws": "A10G"},
    "A6000": {"runpod": "RTXA6000", "lambda": "A6000"},
    "A100-40GB": {"lambda": "A100", "aws": "A100", "gcp": "A100", "azure": "A100"},
    "A100-80GB": {
        "runpod": "A100-80GB",
        "lambda": "A100-80GB",
        "aws": "A100-80GB",
        "gcp": "A100-80GB",
        "azure": "A100-80GB",
    },
    "H100": {"runpod": "H100", "lambda": "H100", "aws": "H100", "gcp": "H100", "azure": "H100"},
}


def canonical_gpu(name: str) -> str:
    """Map a user's spelling (``RTXA6000``, ``a100-80gb``, ``A100``) to the fitburst name."""
    up = name.strip().upper()
    for gpu in SKY_NAMES:
        if up == gpu.upper():
            return gpu
    for gpu, per in SKY_NAMES.items():
        if up in {n.upper() for n in per.values()}:
            return gpu
    raise ValueError(f"unknown GPU {name!r}: choose from {', '.join(SKY_NAMES)}")


def gpu_entry(entry: str) -> tuple[str, int | None]:
    """A ``burst.gpus`` entry as SkyPilot writes accelerators: ``A6000`` (the planner picks how many) or ``A6000:2``
    (two per node) -> (fitburst name, count or None). ValueError for an unknown GPU or a bad count."""
    name, sep, count = entry.strip().partition(":")
    gpu = canonical_gpu(name)
    if not sep:
        return gpu, None
    if not count.strip().isdigit() or int(count) < 1:
        raise ValueError(f"{entry!r}: after the colon comes the number of GPUs per node, e.g. {gpu}:2")
    return gpu, int(count)


# --- the SDPA kernel a CUDA device runs -------------------------------------------------------------------
# The loader (fitburst.models) and the estimates (fitburst.memory) both decide on these facts.


@functools.cache
def efficient_takes_gqa() -> bool:
    """Whether the installed torch's memory-efficient SDPA kernel takes grouped-query heads: from torch 2.14 on (its
    docs: "Memory-efficient attention also supports GQA on NVIDIA CUDA"; torch 2.13's: GQA "currently works only for
    Flash_attention and math kernel on CUDA tensor"). Read from the installed distribution, torch is not imported;
    with no torch here, the current behaviour."""
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return True
    return found is None or (int(found[1]), int(found[2])) >= (2, 14)


def attention_masked(device: Device, attention: str, padded: bool) -> bool:
    """Whether a padded batch (``padded``) hands the attention kernel a b x S x S mask on ``device``: under SDPA and
    eager, not under FlashAttention-2 (``attention`` flash, which runs on CUDA only): transformers
    (masking_utils.flash_attention_mask) gives it the 2D padding mask as it is, which _flash_attention_forward
    unpads into varlen cu_seqlens (modeling_flash_attention_utils._upad_input), the real tokens' q, k and v gathered
    (no more than the padded ones); a packed batch's position ids become cu_seqlens there too, with no mask."""
    return padded and not (attention == "flash" and device.kind == "cuda")


def sdpa_kernel_for(device: Device, dtype: str, padded: bool, gqa: bool, efficient_gqa: bool | None = None) -> str:
    """The kernel torch's SDPA dispatch (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) runs on a CUDA
    ``device`` for a run computing in ``dtype``: flash | efficient | math. FlashAttention-2 needs sm >= 80
    (``supports_bf16``), 16-bit q/k/v and no mask. ``gqa``: SDPA gets fewer k/v heads than query heads, as
    transformers passes them (``enable_gqa=True``) whenever no mask reaches it (``use_gqa_in_sdpa``; a padded
    batch's mask makes it expand them with ``repeat_kv``). Up to torch 2.13 the memory-efficient kernel takes no
    grouped-query heads (its dense constraints instantiate ``check_batch_size_and_num_heads_dense<false>``;
    ``efficient_gqa``: None = as the installed torch, :func:`efficient_takes_gqa`), so such a call with no flash
    falls to the math kernel: fp32 copies of q, k and v, and b*h*s*s fp32 scores and probabilities in every layer.
    cuDNN attention (preferred on some sm 9.0 builds) is not modelled."""
    if device.supports_bf16 and dtype != "fp32" and not padded:
        return "flash"
    takes_gqa = efficient_takes_gqa() if efficient_gqa is None else efficient_gqa
    return "math" if gqa and not padded and not takes_gqa else "efficient"


def expands_kv(device: Device, dtype: str, gqa: bool, efficient_gqa: bool | None = None) -> bool:
    """Whether fitburst's loader gives a grouped-query model (``gqa``) k/v expanded before SDPA on ``device``
    (:data:`fitburst.models.EXPANDED_KV`): where an unmasked call would otherwise fall to the math kernel, so that
    the memory-efficient kernel runs it (b*h*s*d copies of k and v instead of b*h*s*s scores)."""
    return device.kind == "cuda" and gqa and sdpa_kernel_for(device, dtype, False, True, efficient_gqa) == "math"
