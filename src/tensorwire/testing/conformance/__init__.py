"""The transport conformance suite: every case runs against every transport.

Each case is an ``async def case(h: Harness) -> None`` that starts what it needs (a real server on
the harness's transport, or a hand-written peer) on the running event loop and asserts with plain
``assert``. ``run_case(case, scheme)`` runs one on a fresh loop; ``CASES`` lists them all, so a
test module parametrizes ``CASES x schemes`` (see tests/integration/test_conformance.py).

Cases cover round trips of every dtype and shape, in-place gets, batches, concurrency, timeouts,
close, and frames that are corrupt, truncated, over a limit or otherwise hostile. One module per
kind of check:

- ``harness``: ``Harness`` (servers, clients and peers on one transport), ``run_case``, and the
  tensors cases compare (``random_tensor``, ``same_bytes``);
- ``frames``: hand-made frames on a raw connection (``raw``, ``put_frame``, ``read_reply``, ...);
- ``round_trips``: cases through the public client API;
- ``lifecycle``: timeouts and close;
- ``hostile``: corrupt, truncated, lying and over-the-limit frames;
- ``rpc``: hostile input on gRPC.

Every name is re-exported here: ``from tensorwire.testing.conformance import put_frame`` works.
"""

from __future__ import annotations

from tensorwire.testing.conformance.frames import (
    assert_alive_and_empty,
    compressed_put_frame,
    expect_error,
    put_frame,
    raw,
    read_reply,
    still_serves,
)
from tensorwire.testing.conformance.harness import SCHEMES, Case, Harness, random_tensor, run_case, same_bytes
from tensorwire.testing.conformance.hostile import (
    a_bad_part_refuses_the_whole_batch,
    a_get_naming_a_tensor_twice_is_refused,
    a_lying_chunk_head_ends_the_session,
    a_partial_striped_put_is_never_visible,
    an_unauthenticated_peer_cannot_make_the_server_allocate,
    an_unfinished_batch_stores_nothing,
    bad_magic_and_version_end_the_session,
    corrupt_chunk_is_never_stored,
    corrupt_compressed_chunk_is_never_stored,
    corrupt_get_response_is_retried,
    damaged_header_is_caught,
    limits_are_enforced,
    lying_records_are_refused,
    truncated_frame_stores_nothing,
)
from tensorwire.testing.conformance.lifecycle import (
    a_connection_dropped_while_idle_is_noticed,
    a_stalled_request_is_cut_off,
    closed_client_and_server,
    connections_are_bounded_and_idle_ones_dropped,
    each_request_keeps_its_own_deadline,
    silent_server_times_out,
)
from tensorwire.testing.conformance.round_trips import (
    a_batch_in_many_frames_is_one_put,
    batches_are_atomic_and_versioned,
    capacity_is_enforced,
    compressible_and_mixed_tensors_round_trip,
    every_dtype_and_shape,
    get_into_out_in_place,
    large_tensor_many_chunks,
    list_stat_delete,
    many_requests_in_flight,
    non_contiguous_is_sent_contiguous,
    out_mismatch_is_refused,
)
from tensorwire.testing.conformance.rpc import (
    raw_rpc,
    rpc_a_stalled_put_is_cut_off,
    rpc_hostile_puts_store_nothing,
)

RPC_CASES: list[Case] = [rpc_hostile_puts_store_nothing, rpc_a_stalled_put_is_cut_off]


# Cases every transport must pass, through the public client API.
CASES: list[Case] = [
    every_dtype_and_shape,
    non_contiguous_is_sent_contiguous,
    get_into_out_in_place,
    out_mismatch_is_refused,
    large_tensor_many_chunks,
    batches_are_atomic_and_versioned,
    a_batch_in_many_frames_is_one_put,
    compressible_and_mixed_tensors_round_trip,
    list_stat_delete,
    capacity_is_enforced,
    many_requests_in_flight,
    silent_server_times_out,
    closed_client_and_server,
]

# Hostile and broken input in the frame protocol's own bytes (tcp://, memory://).
STREAM_CASES: list[Case] = [
    a_bad_part_refuses_the_whole_batch,
    an_unfinished_batch_stores_nothing,
    a_stalled_request_is_cut_off,
    connections_are_bounded_and_idle_ones_dropped,
    a_connection_dropped_while_idle_is_noticed,
    each_request_keeps_its_own_deadline,
    a_get_naming_a_tensor_twice_is_refused,
    an_unauthenticated_peer_cannot_make_the_server_allocate,
    corrupt_chunk_is_never_stored,
    corrupt_compressed_chunk_is_never_stored,
    a_lying_chunk_head_ends_the_session,
    a_partial_striped_put_is_never_visible,
    bad_magic_and_version_end_the_session,
    damaged_header_is_caught,
    truncated_frame_stores_nothing,
    limits_are_enforced,
    lying_records_are_refused,
    corrupt_get_response_is_retried,
]
STREAM_SCHEMES = ("memory", "tcp")

__all__ = [
    "CASES",
    "Case",
    "Harness",
    "RPC_CASES",
    "SCHEMES",
    "STREAM_CASES",
    "STREAM_SCHEMES",
    "a_bad_part_refuses_the_whole_batch",
    "a_connection_dropped_while_idle_is_noticed",
    "a_batch_in_many_frames_is_one_put",
    "a_get_naming_a_tensor_twice_is_refused",
    "a_lying_chunk_head_ends_the_session",
    "a_partial_striped_put_is_never_visible",
    "a_stalled_request_is_cut_off",
    "an_unauthenticated_peer_cannot_make_the_server_allocate",
    "an_unfinished_batch_stores_nothing",
    "assert_alive_and_empty",
    "bad_magic_and_version_end_the_session",
    "batches_are_atomic_and_versioned",
    "capacity_is_enforced",
    "closed_client_and_server",
    "compressed_put_frame",
    "compressible_and_mixed_tensors_round_trip",
    "connections_are_bounded_and_idle_ones_dropped",
    "corrupt_chunk_is_never_stored",
    "corrupt_compressed_chunk_is_never_stored",
    "corrupt_get_response_is_retried",
    "damaged_header_is_caught",
    "each_request_keeps_its_own_deadline",
    "every_dtype_and_shape",
    "expect_error",
    "get_into_out_in_place",
    "large_tensor_many_chunks",
    "limits_are_enforced",
    "list_stat_delete",
    "lying_records_are_refused",
    "many_requests_in_flight",
    "non_contiguous_is_sent_contiguous",
    "out_mismatch_is_refused",
    "put_frame",
    "random_tensor",
    "raw",
    "raw_rpc",
    "read_reply",
    "rpc_a_stalled_put_is_cut_off",
    "rpc_hostile_puts_store_nothing",
    "run_case",
    "same_bytes",
    "silent_server_times_out",
    "still_serves",
    "truncated_frame_stores_nothing",
]
