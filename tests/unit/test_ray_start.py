"""``bench.peers_ray.start_ray``: Ray started once more when one of its own fixed 30 s waits ran
out on a loaded host (both messages CI has met), any other failure raised as it came, and Ray's
workers asked for niceness 0 (tests/integration/test_ray.py sees them run at it)."""

from __future__ import annotations

from typing import Any

import pytest

from tensorwire.bench.peers_ray import start_ray


class Ray:
    """The two calls start_ray makes, failing the first ``init`` with ``first`` (if any)."""

    def __init__(self, first: Exception | None) -> None:
        self.first = first
        self.calls: list[str] = []

    def init(self, **options: Any) -> None:
        self.calls.append(f"init {sorted(options)}")
        self.options = options
        if self.first is not None:
            first, self.first = self.first, None
            raise first

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.mark.parametrize(
    "first",
    [
        RuntimeError("Timed out waiting for file /tmp/ray/session_x/logs/gcs_server.out"),
        Exception("The current node timed out during startup. This could happen because ..."),
    ],
    ids=["gcs-port-file", "raylet-registration"],
)
def test_a_start_that_ran_out_of_rays_own_wait_is_tried_once_more(
    first: Exception, capsys: pytest.CaptureFixture[str]
) -> None:
    ray = Ray(first)
    start_ray(ray, num_cpus=2)
    init = "init ['_system_config', 'num_cpus']"
    assert ray.calls == [init, "shutdown", init]
    assert "starting it again" in capsys.readouterr().err


def test_any_other_failure_is_raised_and_not_retried() -> None:
    ray = Ray(ValueError("object_store_memory is too large"))
    with pytest.raises(ValueError, match="too large"):
        start_ray(ray, object_store_memory=1 << 40)
    assert ray.calls == ["init ['_system_config', 'object_store_memory']"]


def test_rays_workers_are_asked_for_the_niceness_of_the_rest_and_other_settings_kept() -> None:
    ray = Ray(None)
    start_ray(ray, num_cpus=2, _system_config={"object_timeout_milliseconds": 10})
    assert ray.options["_system_config"] == {"worker_niceness": 0, "object_timeout_milliseconds": 10}
    assert ray.options["num_cpus"] == 2
