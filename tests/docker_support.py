"""Shared pieces of the Docker tier: an engine or a clear skip (never a skip under CI), and the
images built once per session through the same code `make image` runs."""

from __future__ import annotations

import os

import pytest
from docker.errors import DockerException

import docker
from ddpack.images import build_image, default_ca_bundle, default_wheelhouse

TEST_TAG = "ddpack:pytest"
TEST_GPU_TAG = "ddpack:pytest-gpu"


def engine_or_skip() -> docker.DockerClient:
    try:
        client = docker.from_env(timeout=900)
        client.ping()
        return client
    except DockerException as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide a Docker engine: {exc}")
        pytest.skip(f"no Docker engine here ({exc}); `make engine` starts one")


def build_settings() -> dict:
    """What `make image` would pass (the same defaults the build command uses)."""
    return {"wheelhouse": default_wheelhouse(), "ca_bundle": default_ca_bundle()}


def build(variant: str, tag: str) -> str:
    settings = build_settings()
    return build_image(variant, tag, wheelhouse=settings["wheelhouse"], ca_bundle=settings["ca_bundle"], version="pytest")
