import pytest


@pytest.fixture(autouse=True)
def _backend_on(monkeypatch):
    """These tests are of the backends' overrides: on even where the run turns them off
    (``ATTNZOO_FAST=0``)."""
    monkeypatch.setenv("ATTNZOO_FAST", "1")
