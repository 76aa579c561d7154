"""Calls to a busy Prefect API are retried: the tests' own REST client, and Prefect's client as configured here."""

from __future__ import annotations

import httpx
import pytest
from prefect.client.base import PrefectHttpxSyncClient
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, PREFECT_CLIENT_RETRY_JITTER_FACTOR, temporary_settings

from tests.prefect_fixtures import CLIENT_RETRY_ENV, PrefectApi, RetryingTransport, _base_env


class Flaky:
    """Answers the first `failures` requests with `fail` (a status code or an exception), then 204."""

    def __init__(self, failures: int, fail: int | type[httpx.TransportError]) -> None:
        self.failures = failures
        self.fail = fail
        self.seen: list[tuple[str, str, bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path, request.content))
        if len(self.seen) <= self.failures:
            if isinstance(self.fail, int):
                return httpx.Response(self.fail, headers={"Retry-After": "0"}, text="database is locked")
            raise self.fail("connection refused", request=request)
        return httpx.Response(204)


def _api(handler: Flaky, attempts: int = 6) -> PrefectApi:
    api = PrefectApi("http://prefect.invalid/api")
    api.transport = RetryingTransport(attempts=attempts, base_s=0.01, inner=httpx.MockTransport(handler))
    api.client = httpx.Client(base_url="http://prefect.invalid/api", transport=api.transport)
    return api


@pytest.mark.parametrize("fail", [503, 502, 429, httpx.ConnectError, httpx.ReadTimeout, httpx.RemoteProtocolError])
def test_schedule_update_is_retried_until_the_server_answers(fail: int | type[httpx.TransportError]) -> None:
    handler = Flaky(3, fail)
    api = _api(handler)
    response = api.client.patch("/deployments/d/schedules/s", json={"active": True})
    assert response.status_code == 204
    assert api.transport.retried == 3
    # The same request each time: method, path and body.
    assert {seen for seen in handler.seen} == {("PATCH", "/api/deployments/d/schedules/s", b'{"active":true}')}


def test_a_server_that_stays_unavailable_gets_its_last_answer_back_and_an_error_is_not_retried() -> None:
    api = _api(Flaky(100, 503), attempts=4)
    assert api.client.get("/health").status_code == 503
    assert api.transport.retried == 3

    refused = _api(Flaky(100, httpx.ConnectError), attempts=3)
    with pytest.raises(httpx.ConnectError):
        refused.client.get("/health")
    assert refused.transport.retried == 2

    class NotFound(Flaky):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            super().__call__(request)
            return httpx.Response(404)

    missing = NotFound(0, 503)
    api = _api(missing)
    assert api.client.get("/deployments/name/x/y").status_code == 404
    assert len(missing.seen) == 1 and api.transport.retried == 0


def test_create_flow_run_retries_with_one_idempotency_key() -> None:
    handler = Flaky(2, 503)
    api = _api(handler)
    assert api.create_flow_run("dep", {"spec": {}}).status_code == 204
    bodies = {body for _, _, body in handler.seen}
    assert len(handler.seen) == 3 and len(bodies) == 1 and b"idempotency_key" in next(iter(bodies))


def test_processes_under_test_get_the_longer_prefect_client_retry_budget() -> None:
    env = _base_env()
    assert env["PREFECT_CLIENT_MAX_RETRIES"] == CLIENT_RETRY_ENV["PREFECT_CLIENT_MAX_RETRIES"] == "7"


def test_prefect_client_itself_retries_503_and_dropped_connections() -> None:
    # What every Prefect call of the flows (task runs, artifacts, run_deployment) relies on.
    for fail in (503, httpx.ReadError):
        handler = Flaky(2, fail)
        with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 7, PREFECT_CLIENT_RETRY_JITTER_FACTOR: 0}):
            client = PrefectHttpxSyncClient(
                base_url="http://prefect.invalid/api", transport=httpx.MockTransport(handler)
            )
            with client:
                assert client.get("/health").status_code == 204
        assert len(handler.seen) == 3
