"""Commands the cloud node runs besides ``fitburst train`` (see train.yaml): ``check-cuda`` fails the setup when
torch cannot use the GPU, instead of training on CPU at GPU prices."""

from __future__ import annotations

import sys


def check_cuda() -> str | None:
    """None when CUDA is usable here, else what is wrong and how to fix it."""
    import torch

    if torch.cuda.is_available():
        return None
    build = torch.version.cuda
    if build is None:
        return (f"torch {torch.__version__} is a CPU-only build: the node would train on CPU at GPU prices. Install "
                "a CUDA build of torch on the node (FITBURST_NODE_PACKAGES; the launcher's CPU build is not it)")
    return (f"torch {torch.__version__} (CUDA {build}) sees no usable GPU: the driver is missing or older than "
            "this CUDA build needs (see nvidia-smi above); pin a torch build that matches the node's driver")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["check-cuda"]:
        print("usage: python -m fitburst.cloud.node check-cuda", file=sys.stderr)
        return 2
    problem = check_cuda()
    if problem:
        print(f"fitburst node setup: CUDA is not usable: {problem}", file=sys.stderr)
        return 3
    import torch

    print(f"fitburst node setup: CUDA ok ({torch.cuda.get_device_name(0)}, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
