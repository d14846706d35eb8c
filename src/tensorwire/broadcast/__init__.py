"""Publish once, read by many: the relay (docs/protocol.md §15).

``Subscriber`` (subscriber.py) keeps a model at the newest generation of a prefix; the origin's
``RelayCoordinator`` (coordinator.py, an extension of its server) strings the readers of one
generation into pipelined chains (chains.py) so the origin sends the model's bytes about once;
each reader's ``RelayPeer`` (peer.py) forwards the chunks it has verified. source.py is the one
place that knows how the origin keeps generations. host.py: per host, one ``Subscriber`` (with
``share=``) reads from the network and ``HostReader``s on that host read its shared memory.

The package's surface is what a reader uses; the origin's and the chains' parts are imported from
their modules (``broadcast.coordinator.RelayCoordinator``, ``broadcast.peer.RelayPeer``,
``broadcast.chains.Chains``). Imported from here they still work for one release and warn.
"""

from typing import TYPE_CHECKING

from tensorwire._deprecated import moved
from tensorwire.broadcast.host import HostReader, HostShare
from tensorwire.broadcast.subscriber import Subscriber

# Hidden from type checkers: to them a module __getattr__ would make every name of the package
# exist, a typo included; the deprecated names are for old code at run time only.
if not TYPE_CHECKING:
    __getattr__ = moved(
        "tensorwire.broadcast",
        {
            "Chains": "tensorwire.broadcast.chains",
            "RelayCoordinator": "tensorwire.broadcast.coordinator",
            "RelayPeer": "tensorwire.broadcast.peer",
        },
    )

__all__ = ["HostReader", "HostShare", "Subscriber"]
