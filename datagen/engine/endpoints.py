"""A generation server as the rest of the pipeline sees it: where it is and how much it takes."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import SecretStr

__all__ = ["ServerEndpoint"]


@dataclass(frozen=True, slots=True)
class ServerEndpoint:
    """One SGLang (or stand-in) HTTP server."""

    name: str  # e.g. "gpu3" or "server-3"; used in logs and failure messages
    url: str  # base URL, e.g. "http://127.0.0.1:30003"
    api_key: SecretStr | None = None
    max_running_requests: int | None = None  # effective value from /server_info, when known
    log_path: str | None = None  # server log file when the pipeline started it (for failure messages)

    def __repr__(self) -> str:  # never print the key
        return f"ServerEndpoint(name={self.name!r}, url={self.url!r}, max_running_requests={self.max_running_requests})"
