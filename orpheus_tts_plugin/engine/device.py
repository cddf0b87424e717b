"""Which torch device a `device` setting names, checked against this torch build before anything loads."""

from __future__ import annotations

from ..errors import DeviceUnavailableError


def resolve_device(device: str) -> str:
    """`device`, or CUDA if available when it is "auto"; DeviceUnavailableError in one line saying what to use
    instead if this torch cannot run on it."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    why = _why_not(device)
    if why is not None:
        raise DeviceUnavailableError(f"device {device!r}: {why}")
    return device


def _why_not(device: str) -> str | None:
    """Why this torch cannot run on `device` and what to use instead (CUDA on a CPU build, a GPU index past the
    last, MPS off a Mac); None if it can."""
    import torch

    try:
        kind = torch.device(device)
    except (RuntimeError, ValueError):
        return "not a device: use cpu, cuda, cuda:N, mps or auto"
    if kind.type == "cuda":
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) is built without CUDA; use --device cpu, or a CUDA build of torch"
        count = torch.cuda.device_count()
        if count == 0:
            return "no CUDA GPU is visible here; use --device cpu"
        if kind.index is not None and kind.index >= count:
            return f"only {count} CUDA GPU(s) here; use cuda:0 to cuda:{count - 1}"
    elif kind.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available here; use --device cpu"
    return None
