"""Talking to generation servers: the HTTP client and the box-wide continuous dispatcher."""

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
    DispatcherStats,
    EngineStalled,
    GenerateJob,
    RetriesExhausted,
    ServerStats,
)

__all__ = [
    "SAMPLING_KEYS",
    "AuthError",
    "Dispatcher",
    "DispatcherClosed",
    "DispatcherStats",
    "EngineError",
    "EngineStalled",
    "GenerateJob",
    "GenerateResult",
    "LoadInfo",
    "ProtocolError",
    "RequestRejected",
    "RequestTimeout",
    "RetriesExhausted",
    "SGLangClient",
    "ServerError",
    "ServerStats",
    "ServerUnreachable",
    "TransientError",
    "sampling_params_for",
]
