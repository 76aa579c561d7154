"""Talking to generation servers: the HTTP client, the box-wide continuous dispatcher and its gate and stats."""

from datagen.engine.client import (
    SAMPLING_KEYS,
    AuthError,
    EngineError,
    GenerateResult,
    LoadInfo,
    ProtocolError,
    RequestRejected,
    RequestTimeout,
    ServerError,
    ServerUnreachable,
    SGLangClient,
    TransientError,
    sampling_params_for,
)
from datagen.engine.dispatcher import (
    Dispatcher,
    DispatcherClosed,
    EngineStalled,
    GenerateJob,
    RetriesExhausted,
    SubmitTimeout,
)
from datagen.engine.gate import GateClosed, PlanOrderGate
from datagen.engine.stats import DispatcherStats, ServerStats

__all__ = [
    "SAMPLING_KEYS",
    "AuthError",
    "Dispatcher",
    "DispatcherClosed",
    "DispatcherStats",
    "EngineError",
    "EngineStalled",
    "GateClosed",
    "GenerateJob",
    "GenerateResult",
    "LoadInfo",
    "PlanOrderGate",
    "ProtocolError",
    "RequestRejected",
    "RequestTimeout",
    "RetriesExhausted",
    "SGLangClient",
    "ServerError",
    "ServerStats",
    "ServerUnreachable",
    "SubmitTimeout",
    "TransientError",
    "sampling_params_for",
]
