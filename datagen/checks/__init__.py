"""Environment checks: each is one line of a report (pass, fail or skipped, with an actionable reason)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CheckResult", "CheckStatus"]

CheckStatus = Literal["pass", "fail", "skipped"]


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one check."""

    name: str  # e.g. "gpu.compute_capability", "model_dir.weights", "s3.namespace_free"
    status: CheckStatus
    detail: str  # what was found, and what to do about a failure

    @property
    def failed(self) -> bool:
        return self.status == "fail"
