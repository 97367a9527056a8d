"""Schemathesis against the worker API's OpenAPI document: no generated request gets a 5xx (issue 11).

A real worker process with a shared secret; generated bodies for every operation, bounded examples.
"""

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings

from tests.worker_process import worker_process
from worker.openapi import worker_openapi_spec

SECRET = "fuzz-worker-secret"
SCHEMA = schemathesis.openapi.from_dict(worker_openapi_spec())


@pytest.fixture(scope="module")
def live_worker(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("fuzz-worker") / "worker.log"
    args = ("--model", "random-tiny", "--max-model-len", "256", "--shared-secret", SECRET)
    with worker_process(*args, log_path=log_path) as url:
        yield url


def test_the_worker_serves_its_openapi_document(live_worker):
    served = requests.get(f"{live_worker}/openapi.json", timeout=10).json()
    assert served == worker_openapi_spec() and "/v1/generate" in served["paths"]


@SCHEMA.parametrize()
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_generated_request_gets_a_5xx(case, live_worker):
    response = case.call(base_url=live_worker, headers={"Authorization": f"Bearer {SECRET}"}, timeout=60)
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
