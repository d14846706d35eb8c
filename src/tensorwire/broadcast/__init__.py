"""Publish once, read by many: the relay (docs/protocol.md §15).

``Subscriber`` (subscriber.py) keeps a model at the newest generation of a prefix; the origin's
``RelayCoordinator`` (coordinator.py, an extension of its server) strings the readers of one
generation into pipelined chains (chains.py) so the origin sends the model's bytes about once;
each reader's ``RelayPeer`` (peer.py) forwards the chunks it has verified. source.py is the one
place that knows how the origin keeps generations. host.py: per host, one ``Subscriber`` (with
``share=``) reads from the network and ``HostReader``s on that host read its shared memory.
"""

from tensorwire.broadcast.chains import Chains
from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.broadcast.host import HostReader, HostShare
from tensorwire.broadcast.peer import RelayPeer
from tensorwire.broadcast.subscriber import Subscriber

__all__ = ["Chains", "HostReader", "HostShare", "RelayCoordinator", "RelayPeer", "Subscriber"]
