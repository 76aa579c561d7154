"""Everything the stand-in's HTTP handlers share: resolved args, tokenizer, synthetic model, scheduler, counters."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from typing import Any

from datagen.chat import ChatTokenizer
from datagen.standin import SGLANG_VERSION
from datagen.standin.knobs import Knobs
from datagen.standin.prefix_cache import PrefixCache
from datagen.standin.scheduler import Scheduler
from datagen.standin.synthetic import SyntheticModel

__all__ = ["SGLANG_VERSION", "ServerState", "Status"]


class Status:
    """Values of SGLang's ServerStatus that the stand-in uses."""

    STARTING = "Starting"
    UP = "Up"
    UNHEALTHY = "UnHealthy"


@dataclass(eq=False)
class ServerState:
    """Shared state of one stand-in process."""

    args: argparse.Namespace
    knobs: Knobs
    config: dict[str, Any]
    tokenizer: ChatTokenizer
    model: SyntheticModel
    scheduler: Scheduler
    resolved: dict[str, Any]  # resolved server args as /server_info reports them (secrets in clear, as SGLang)
    launch_command: str  # " ".join(argv), as SGLang's (unredacted)
    context_len: int
    max_req_input_len: int
    max_running_per_dp: int
    status: str = Status.STARTING
    startup_time: float = field(default_factory=time.time)
    generation_requests: int = 0  # HTTP generation requests received (stall knob)
    completed_requests: int = 0  # HTTP generation requests answered 200 (crash knob)
    stall_logged: bool = False
    fault_rng: random.Random = field(default_factory=random.Random)
    prefix_cache: PrefixCache = field(default_factory=lambda: PrefixCache(0, enabled=False))  # set by the server

    @property
    def served_model_name(self) -> str:
        name: str = self.resolved["served_model_name"]
        return name

    @property
    def vocab_size(self) -> int:
        size = self.config.get("vocab_size") or self.config.get("text_config", {}).get("vocab_size")
        return int(size) if size else self.tokenizer.vocab_size

    @property
    def stalled(self) -> bool:
        stall_after = self.knobs.stall_after
        return stall_after is not None and self.generation_requests > stall_after

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])
