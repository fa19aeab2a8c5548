"""The one place where tensors leave the device, and where the host waits for it.

On an accelerator every read of a device value makes the host wait for the queued
work, so the decoding loop reads once per step (``racer.engine.decoder``): each node's
chosen token and the drafter's top-k ids travel together. Nothing else in the engine,
the budget or the fast paths converts a tensor to a host value.
"""

from __future__ import annotations

import numpy as np
import torch


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s values as a host array (waits for the device)."""
    return tensor.detach().cpu().numpy()


def host_float(tensor: torch.Tensor) -> float:
    """A one-element tensor's value as a Python float (waits for the device)."""
    return float(to_host(tensor.reshape(-1)[:1].float())[0])


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished its queued work (for timing; a no-op on the CPU,
    whose operations finish before they return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
