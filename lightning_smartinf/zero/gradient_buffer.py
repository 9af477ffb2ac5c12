"""Where ZeRO keeps this rank's reduced gradient partitions (``gradient_buffer``): the accelerator, or host memory.

Imports DeepSpeed only when asked (its accelerator), so the installer and the optimizer share it without a cycle.
"""

from __future__ import annotations

import logging

import torch

__all__ = [
    "AUTO_ACCELERATOR_SHARE",
    "AUTO_ACCUMULATING_SHARE",
    "GradientBufferError",
    "gradient_buffer_device",
]


class GradientBufferError(ValueError):
    """``gradient_buffer`` asks for accelerator memory the accelerator does not have (raised while ZeRO sets up)."""


#: ``gradient_buffer="auto"`` keeps the gradients on the accelerator only if they take at most this share of its free
#: memory at set-up: forward and backward need the rest.
AUTO_ACCELERATOR_SHARE = 0.25
#: The share when the step accumulates micro-batches (a third of the free memory left to forward and backward): in host
#: memory every micro-batch after the first takes the partitions across the link and back (8 B/param in fp32) to add
#: to them, seconds per micro-batch at billions of parameters.
AUTO_ACCUMULATING_SHARE = 2 / 3


def gradient_buffer_device(setting: str, needed_bytes: int, accumulation: int = 1) -> str | None:
    """The device to keep the reduced gradient partitions on for ``gradient_buffer=setting``, or ``None`` to leave
    them in ZeRO's pinned host buffer. ``needed_bytes``: the buffer, and the residual error feedback keeps with it;
    ``accumulation``: the micro-batches each step adds up.

    ``"auto"`` moves them to a real accelerator where they take at most :data:`AUTO_ACCELERATOR_SHARE` of its free
    memory (:data:`AUTO_ACCUMULATING_SHARE` when the step accumulates). ``"accelerator"`` always moves them, and
    refuses an accelerator without room for them; on a machine without one that is host memory again (unpinned),
    which runs the same code path as a GPU.

    Raises:
        GradientBufferError: ``"accelerator"`` on an accelerator with less free memory than ``needed_bytes``.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if setting == "host" or (setting == "auto" and accelerator.is_synchronized_device()):
        return None
    device = accelerator.current_device_name()
    if accelerator.is_synchronized_device():
        return device
    if torch.device(device).type == "cuda":
        free = int(torch.cuda.mem_get_info(torch.device(device))[0])
    else:
        free = int(accelerator.available_memory())
    if setting == "auto":
        share = AUTO_ACCUMULATING_SHARE if accumulation > 1 else AUTO_ACCELERATOR_SHARE
        if needed_bytes > share * free:
            logging.getLogger(__name__).info(
                "gradient_buffer='auto': the gradient partitions (%.2f GiB) would take more than %d%% of %s's free "
                "memory (%.2f GiB); they stay in pinned host memory%s.",
                needed_bytes / 2**30,
                int(share * 100),
                device,
                free / 2**30,
                f", and each of the {accumulation - 1} micro-batches after a step's first crosses the link twice"
                if accumulation > 1
                else "",
            )
            return None
        return device
    if needed_bytes > free:
        raise GradientBufferError(
            f"`gradient_buffer='accelerator'` needs {needed_bytes / 2**30:.2f} GiB of {device} memory for this rank's "
            f"gradient partitions (and error-feedback residual), but {free / 2**30:.2f} GiB is free. Pass "
            "`gradient_buffer='host'` (pinned host memory) or 'auto', or train on more ranks."
        )
    return device
