"""What the servers and the workers ask of Ray: placement groups reserved and released, the node of
each bundle, and results gathered with a deadline, Ray's exceptions translated to ``ClusterError``.

Ray's names end here and in the actor: the callers above get ``tensorwire.errors`` types only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.placement_group import remove_placement_group as _remove
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tensorwire.errors import ClusterError, ClusterTimeout

Bundle = Mapping[str, float]


def reserve(bundles: Sequence[Bundle], strategy: str, timeout: float, what: str) -> PlacementGroup:
    """A placement group of ``bundles``, ready (its resources held); ``ClusterTimeout`` naming
    ``what`` and the bundles when the cluster cannot give them within ``timeout`` s."""
    group: PlacementGroup = placement_group([dict(b) for b in bundles], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError as exc:
        release(group)
        raise ClusterTimeout(
            f"waited {timeout}s for Ray to reserve {len(bundles)} x {dict(bundles[0])} ({strategy}) for "
            f"{what}; the cluster has {ray.available_resources()} free"  # type: ignore[no-untyped-call]
        ) from exc
    except BaseException:
        release(group)
        raise
    return group


def release(group: PlacementGroup) -> None:
    """Give a placement group's resources back (one already removed is fine)."""
    with contextlib.suppress(Exception):  # a cluster that is shutting down takes them back itself
        _remove(group)


def bundle_nodes(group: PlacementGroup) -> list[str]:
    """The Ray node id each bundle of a ready placement group landed on, in bundle order."""
    nodes: Mapping[int, str] = placement_group_table(group)["bundles_to_node_id"]
    return [nodes[index] for index in range(len(nodes))]


def in_bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


def gather(refs: Sequence[Any], names: Sequence[str], timeout: float, what: str) -> list[Any]:
    """The results of ``refs`` (Ray object refs) in order. The first that fails raises
    ``ClusterError`` naming it (``names[i]``) at once, without waiting for the others; when
    ``timeout`` s pass first, ``ClusterTimeout`` naming ``what`` and those not done. The caller
    cancels or kills whatever is still running."""
    pending = {ref: index for index, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    deadline = time.monotonic() + timeout
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
        if not done:
            late = ", ".join(names[i] for i in sorted(pending.values()))
            raise ClusterTimeout(f"waited {timeout}s for {what}; not done: {late}")
        for ref in done:
            index = pending.pop(ref)
            results[index] = result(ref, names[index])
    return results


def result(ref: Any, name: str) -> Any:
    """``ray.get(ref)`` of a finished ref, a failure translated to ``ClusterError`` naming ``name``."""
    try:
        return ray.get(ref, timeout=0)
    except ray.exceptions.RayTaskError as exc:  # the function raised: name its own exception
        raise ClusterError(f"{name} failed: {type(exc.cause).__name__}: {exc.cause}") from exc
    except ray.exceptions.RayError as exc:  # the process died, was killed or cancelled
        raise ClusterError(f"{name} failed: {type(exc).__name__}: {exc}") from exc
