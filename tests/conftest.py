"""Markers for the whole suite, given here rather than in each file so a test's tier follows from
where it lives and what it costs.

- By folder: every test carries its folder's name as a marker (``unit``, ``integration``,
  ``fault``, ``adversarial``, ``deploy``, ``fuzz``, ``bench``), so ``pytest -m adversarial`` runs
  one red-team folder without a path.
- By cost, ``slow``: the folders whose every test starts processes or kills them (``bench``,
  ``fault``), and the files and tests listed below, each measured over about 2 seconds on the
  2-core machine (``pytest --durations``): servers in processes, netns, Ray, a browser, training
  runs. ``make test-fast`` (``-m "not slow"``) leaves them out; ``make test`` runs everything.
  A new test that starts processes belongs here (or takes ``@pytest.mark.slow`` itself).
- ``xdist_group``: ``make test`` runs in parallel (pytest-xdist, ``--dist loadgroup``); tests
  that share something of the machine's run in one worker, one after another: network namespaces
  (routes and bridges of the host), the browser, a Ray cluster, and tests whose assertions are
  timings that a busy neighbour would stretch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent

FOLDERS = ("unit", "integration", "fault", "adversarial", "deploy", "fuzz", "bench", "engines")
SLOW_FOLDERS = frozenset({"bench", "fault", "engines"})

# Files (path under tests/) whose tests are all slow, or slow enough that the few quick ones share a
# costly module fixture with them; then single tests (file::function, every parameter), each
# measured over 2 s in a full run on 2 cores (`pytest --durations=0`).
SLOW_FILES = frozenset({
    "adversarial/test_cli_exit_clean.py",
    "adversarial/test_conn_limits.py",
    "adversarial/test_psid_checkpoints.py",
    "adversarial/test_psid_observers.py",
    "adversarial/test_publish_slow_disk.py",
    "adversarial/test_rdma_flood.py",
    "adversarial/test_rdma_teardown.py",
    "adversarial/test_dcp_metadata.py",
    "adversarial/test_hf_checkpoint.py",
    "adversarial/test_hf_weights.py",
    "adversarial/test_ray_rdt_peers.py",
    "adversarial/test_repl_credentials.py",
    "adversarial/test_repl_peers.py",
    "adversarial/test_store_pinned.py",
    "adversarial/test_store_uploads.py",
    "adversarial/test_teardown_clients.py",
    "adversarial/test_teardown_listeners.py",
    "adversarial/test_unauth_grpc_memory.py",
    "adversarial/test_unauth_seed_training.py",
    "adversarial/test_unauth_user_stubs.py",
    "deploy/test_slurm_recipe.py",
    "integration/test_dashboard_app.py",
    "integration/test_dashboard_browser.py",
    "integration/test_dataset_scatter.py",
    "integration/test_dcp.py",
    "integration/test_hf.py",
    "integration/test_host_share.py",
    "integration/test_metrics.py",
    "integration/test_probe.py",
    "integration/test_ps_compression.py",
    "integration/test_ps_launch.py",
    "integration/test_ps_relay.py",
    "integration/test_ray.py",
    "integration/test_ray_rdt.py",
    "integration/test_security_e2e.py",
    "integration/test_sharded.py",
    "integration/test_sharded_fsdp.py",
    "integration/test_tcp_server.py",
    "integration/test_tutorial_commands.py",
})  # fmt: skip
SLOW_TESTS = frozenset({
    "adversarial/test_capacity_one_ledger.py::test_tensors_do_not_fit_beside_an_exchange_round",
    "adversarial/test_cli_shm.py::test_files_planted_under_the_next_segment_names_cost_no_put",
    "adversarial/test_dashboard_lockout.py::test_the_in_server_page_names_the_serve_flag_of_its_bound",
    "adversarial/test_dashboard_service.py::test_beyond_loopback_the_page_refuses_plain_http",
    "adversarial/test_dashboard_service.py::test_inside_a_server_the_page_runs_off_its_event_loop",
    "adversarial/test_generation_quotas.py::test_one_client_host_has_parts_in_a_bounded_number_of_transactions",
    "adversarial/test_rdma_exposure.py::test_a_server_closed_under_a_parked_engine_write_ends_cleanly",
    "adversarial/test_rdma_exposure.py::test_an_engine_asked_for_another_address_accepts_connections_on_its_interface_only",
    "adversarial/test_sharded_part_bounds.py::test_open_transactions_are_bounded_per_connection_and_per_server",
    "adversarial/test_share_followers.py::test_a_followers_views_pin_the_share_only_for_a_while",
    "adversarial/test_store_names.py::test_serve_max_tensors_is_enforced_and_shown",
    "adversarial/test_teardown_streams.py::test_a_watchdog_cut_mid_send_leaves_the_server_running",
    "adversarial/test_teardown_streams.py::test_an_shm_put_left_half_committed_is_dropped_with_its_connection",
    "adversarial/test_teardown_streams.py::test_close_wakes_a_read_and_a_second_wait_for_the_same_readiness",
    "adversarial/test_unauth_exchange_bounds.py::test_compressed_gradients_are_bounded_by_their_decoded_size",
    "deploy/test_helm_chart.py::test_every_manifest_validates_against_the_kubernetes_schemas",
    "fuzz/test_fuzz_frames.py::test_live_server_survives_mutated_frames",
    "fuzz/test_fuzz_frames.py::test_mutated_frames_never_make_the_server_log_an_unexpected_exception",
    "fuzz/test_fuzz_frames.py::test_mutated_frames_raise_only_tensorwire_errors",
    "integration/test_cli.py::test_data_dir_survives_a_restart",
    "integration/test_cli.py::test_file_errors",
    "integration/test_cli.py::test_get_of_a_missing_key_exits_1_without_traceback",
    "integration/test_cli.py::test_serve_prints_its_address",
    "integration/test_generations.py::test_a_reader_racing_a_publisher_never_sees_a_mix",
    "integration/test_grpc_third_party.py::test_refusals_are_success_false_with_a_message",
    "integration/test_grpc_third_party.py::test_upload_and_download",
    "integration/test_inline_calls.py::test_a_closed_client_wakes_its_borrower",
    "integration/test_inline_calls.py::test_a_connection_dropped_while_lent_is_replaced",
    "integration/test_inline_calls.py::test_a_stopped_server_times_out_an_inline_get",
    "integration/test_ps.py::test_a_reader_that_never_reads_does_not_stall_training",
    "integration/test_ps.py::test_adamw_and_a_torch_optimizer_instance_are_accepted",
    "integration/test_ps.py::test_async_and_ssp_reach_the_demo_accuracy",
    "integration/test_ps.py::test_sync_equals_single_process_training",
    "integration/test_rdma.py::test_conformance_over_rdma",
    "integration/test_rdma.py::test_no_silent_fallback_without_rdma_devices",
    "integration/test_relay.py::test_tensorwire_serve_relay_networks_lets_readers_relay_on_another_interface",
    "integration/test_relay.py::test_tensorwire_serve_relays_its_generations_to_four_readers",
    "integration/test_shm.py::test_cli_serves_shm",
    "unit/test_exchange_split.py::test_requests_carry_each_piece_once_in_order_to_its_server",
    "unit/test_exchange_split.py::test_split_covers_every_element_once_and_balances_the_servers",
    "unit/test_placement.py::test_every_element_is_in_exactly_one_shard",
})  # fmt: skip

# The groups whose tests run on one worker, one after another (--dist loadgroup), by file or by
# file::function. netns: namespaces, veths and bridges are the host's, and their bandwidth
# figures need the link to themselves. browser, ray: one chromium, one Ray cluster at a time.
# timing: assertions on how long something waited or spun. The rest are modules whose one
# module-scoped fixture (server processes, a sharded cluster) costs more than their tests: on one
# worker it is made once instead of once per worker.
GROUPS = {
    "adversarial/test_rdma_exposure.py": "netns",
    "bench/test_bench_exchange_smoke.py::test_bench_exchange_in_network_namespaces": "netns",
    "fault/test_broadcast_netns.py": "netns",
    "fault/test_partition.py": "netns",
    "fault/test_ps_leadership_partition.py": "netns",
    "fault/test_scaling_netns.py": "netns",
    "integration/test_dashboard_browser.py": "browser",
    "bench/test_bench_peers_smoke.py": "ray",
    "integration/test_ray.py": "ray",
    "integration/test_ray_rdt.py": "ray",
    "integration/test_busy_poll.py": "timing",
    "fault/test_faults.py": "timing",
    "fault/test_ps_faults.py": "timing",
    # Leases of 1-3 s: a term held against a busy machine's stalls.
    "fault/test_ps_leadership_faults.py": "timing",
    "adversarial/test_ps_leadership_attacks.py": "timing",
    "integration/test_ps_leadership.py": "timing",
    "integration/test_coordinator_etcd.py": "coordinator",
    "bench/test_bench_chaos_smoke.py": "timing",
    "adversarial/test_cli_exit_clean.py": "test_cli_exit_clean",
    "integration/test_grpc_third_party.py": "test_grpc_third_party",
    "integration/test_host_share.py": "test_host_share",
    "integration/test_inline_calls.py": "test_inline_calls",
    "integration/test_security_e2e.py": "test_security_e2e",
    "integration/test_sharded.py": "test_sharded",
    "integration/test_tcp_server.py": "test_tcp_server",
}


def _where(item: pytest.Item) -> tuple[str, str]:
    """(path under tests/, path::function name without parameters)."""
    path = Path(str(item.path)).relative_to(TESTS).as_posix()
    function = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
    return path, f"{path}::{function}"


# tryfirst: pytest-xdist's worker reads xdist_group in its own collection hook (to suffix the node
# ids its scheduler groups by); the marks must be there before it looks.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A file renamed or removed must leave these lists too: its tests would silently lose `slow`.
    named = {entry.split("::", 1)[0] for entry in (*SLOW_FILES, *SLOW_TESTS, *GROUPS)}
    gone = sorted(path for path in named if not (TESTS / path).is_file())
    if gone:
        raise pytest.UsageError(f"tests/conftest.py names test files that do not exist: {gone}")
    for item in items:
        path, test = _where(item)
        folder = path.split("/", 1)[0]
        if folder in FOLDERS:
            item.add_marker(folder)
        if folder in SLOW_FOLDERS or path in SLOW_FILES or test in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        group = GROUPS.get(test) or GROUPS.get(path)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
