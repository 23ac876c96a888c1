"""``--workers``: a fixed N or an elastic MIN-MAX range. Runs on the driver.
"""

from __future__ import annotations

import re
from typing import Any, Optional
from ray_ddp.errors import ConfigError


def parse_workers(value: Any) -> Any:
    """``--workers``: N (an int) or an elastic range MIN-MAX (kept as the string "MIN-MAX";
    MIN == MAX is the fixed N)."""
    if isinstance(value, bool):
        raise ConfigError(f"--workers must be N or MIN-MAX, got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    match = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
    if match:
        low, high = int(match[1]), int(match[2])
        if low < 1 or high < low:
            raise ConfigError(f"--workers {text}: an elastic range needs 1 <= MIN <= MAX, e.g. 2-8")
        return low if low == high else f"{low}-{high}"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    raise ConfigError(f"--workers must be a number N or a range MIN-MAX (e.g. 2-8), got {text!r}")


def worker_range(workers: Any) -> Optional[tuple[int, int]]:
    """(MIN, MAX) of ``--workers`` (N gives (N, N)); None when not given."""
    if workers is None:
        return None
    value = parse_workers(workers)
    if isinstance(value, int):
        return value, value
    low, high = value.split("-")
    return int(low), int(high)
