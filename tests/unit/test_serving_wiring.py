"""What `tasks.serving` hands the dispatcher from `Settings`, checked with a fake fleet and a recording dispatcher."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from datagen.layout import RunLayout
from datagen.runspec import RunSpec
from datagen.settings import Settings
from tasks import serving as serving_module
from tasks.serving import serving


class _RecordingDispatcher:
    """Stands in for `Dispatcher`: keeps what it was built with, serves nothing."""

    def __init__(self, endpoints: list[Any], **kwargs: Any) -> None:
        self.endpoints, self.kwargs = endpoints, kwargs

    def __enter__(self) -> _RecordingDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait_ready(self, timeout_s: float) -> None:
        return None


def _served_kwargs(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    fleet = SimpleNamespace(endpoints=["server-0"], restart=lambda e: None, stop=lambda: None)
    monkeypatch.setattr(serving_module.provisioning, "provision", lambda *a: fleet)
    monkeypatch.setattr(serving_module, "Dispatcher", _RecordingDispatcher)
    with serving(settings, RunSpec(), RunLayout(tmp_path), start=lambda f: None) as served:
        dispatcher = served.dispatcher
    assert isinstance(dispatcher, _RecordingDispatcher)
    return dispatcher.kwargs


def test_the_affinity_wait_reaches_the_dispatcher_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAGEN_AFFINITY_WAIT_S", "0.5")
    kwargs = _served_kwargs(Settings(work_dir=tmp_path), tmp_path, monkeypatch)
    assert kwargs["affinity_wait_s"] == 0.5
    assert kwargs["hang_timeout_s"] == Settings().server_hang_timeout_s
    # Unset: the dispatcher's own default, now the setting's.
    monkeypatch.delenv("DATAGEN_AFFINITY_WAIT_S")
    assert _served_kwargs(Settings(work_dir=tmp_path), tmp_path, monkeypatch)["affinity_wait_s"] == 2.0


def test_a_negative_affinity_wait_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_AFFINITY_WAIT_S", "-1")
    with pytest.raises(ValidationError) as refused:
        Settings()
    error = str(refused.value)
    assert "affinity_wait_s" in error and "greater than or equal to 0" in error
    assert Settings(affinity_wait_s=0).affinity_wait_s == 0  # 0 is allowed: never wait
