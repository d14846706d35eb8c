"""GEN_DROP does not pull generations away from under another connection's lease (issue 32,
review 1 #10): before, any client's drop ended every other connection's leases on the prefix and
deleted its durable generations (a sharded checkpoint being read, a rollback target), which a
publish can never do (it never retires a leased generation). A drop is refused, naming the leases,
while another connection holds a live one; the connection's own leases do not stand in its way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire.errors import KeyNotFound, NotAuthorized
from tensorwire.store import TensorStore
from tensorwire.store.generation_disk import ROOT, prefix_dir
from tensorwire.testing.process import wait_for


def test_a_drop_is_refused_while_another_connection_holds_a_lease(tmp_path: Path) -> None:
    store = TensorStore(capacity=64 << 20, data_dir=tmp_path)
    with (
        tensorwire.ServerThread(store=store) as srv,
        tensorwire.connect(srv.url) as writer,
        tensorwire.connect(srv.url) as reader,
    ):
        writer.publish("ckpt", {"w": torch.arange(8.0)})
        writer.publish("ckpt", {"w": torch.arange(8.0) + 1})
        lease = reader.lease("ckpt", 1, 30)
        with pytest.raises(NotAuthorized, match=r"other connections hold 1 leases on its generations \(1\)"):
            writer.drop_generations("ckpt")  # before: dropped, the reader's lease ended, files deleted
        assert reader.get("ckpt/w", at=1).equal(torch.arange(8.0))  # the reader's generation is there
        assert (tmp_path / ROOT / prefix_dir("ckpt")).is_dir()
        lease.release()
        assert writer.drop_generations("ckpt") == 2  # nobody else holds one now
        with pytest.raises(KeyNotFound):
            reader.manifest("ckpt")
        assert not (tmp_path / ROOT / prefix_dir("ckpt")).exists()


def test_a_connections_own_lease_and_an_expired_one_do_not_stop_a_drop() -> None:
    with (
        tensorwire.ServerThread() as srv,
        tensorwire.connect(srv.url) as owner,
        tensorwire.connect(srv.url) as other,
    ):
        owner.publish("mine", {"w": torch.zeros(4)})
        owner.lease("mine", 1, 30)
        assert owner.drop_generations("mine") == 1  # its own lease ends with the drop
        owner.publish("brief", {"w": torch.zeros(4)})
        other.lease("brief", 1, 0.05)

        def dropped() -> bool:
            try:
                return owner.drop_generations("brief") == 1
            except NotAuthorized:
                return False  # the lease has not run out yet

        wait_for(dropped, 10, "the other connection's lease to run out")
        assert srv.server.generations.leases == 0
