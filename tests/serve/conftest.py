"""Fixtures of the OpenAI-server tests: a live server (real HTTP on 127.0.0.1) per test module, and the
real `openai` client on it."""

from __future__ import annotations

import pytest

from tests.serve.test_openai_server import live_server


@pytest.fixture(scope="module")
def server(smollm2_pipeline):
    """(base URL, app) of a live server on a free port; shut down after the module."""
    with live_server(smollm2_pipeline, max_batch_size=4) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
