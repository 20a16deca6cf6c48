"""A memory budget becomes per-key cap ceilings, from the first step's measured peak."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["derive_ceilings", "measure_peak", "reset_peak"]


def derive_ceilings(caps: Mapping[str, int], peak_bytes: int, budget_bytes: int) -> dict[str, int]:
    """Ceilings that keep a step under ``budget_bytes``, from one step's peak
    memory at ``caps``, assuming memory grows linearly with every cap."""
    if peak_bytes <= 0:
        raise ValueError(f"peak_bytes must be > 0, got {peak_bytes}")
    scale = budget_bytes / peak_bytes
    return {key: max(1, int(cap * scale)) for key, cap in caps.items()}


def _first_tensor(data: Any) -> torch.Tensor | None:
    values = data.values() if isinstance(data, Mapping) else getattr(data, "__dict__", {}).values()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def reset_peak(data: Any) -> None:
    tensor = _first_tensor(data)
    if tensor is None or tensor.device.type != "cuda":
        raise ValueError(
            "ddpad: memory_budget measures the first step's peak with torch.cuda.max_memory_allocated "
            "and needs a CUDA input; on other devices give max_caps={key: ceiling}"
        )
    torch.cuda.reset_peak_memory_stats(tensor.device)


def measure_peak(data: Any) -> int:
    tensor = _first_tensor(data)
    assert tensor is not None
    return int(torch.cuda.max_memory_allocated(tensor.device))
