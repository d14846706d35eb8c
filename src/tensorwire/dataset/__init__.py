"""Dataset scatter: ship the shards of a data set to the nodes that train on them, and read them there.

::

    tensorwire dataset scatter ./images --to tcp://node1:7070,tcp://node2:7070
    tensorwire dataset fetch tcp://127.0.0.1:7070 --out ./local     # on a node
    ds = tensorwire.dataset.ShardDataset("tcp://127.0.0.1:7070")   # or its --data-dir

``scatter`` (scatter.py) cuts the source into shards (plan.py) and sends them in parallel, checking
every item against the node's own hash of what it holds (DIGEST, digest.py) and writing each
shard's manifest last, so a re-run sends only what is missing. Each node records which tree a
data set's name holds (identity.py): a scatter of another tree under that name is refused unless
``replace=True`` (``--replace``). ``fetch`` (fetch.py) and ``ShardDataset`` (shards.py) read the
complete shards a node holds (reader.py); ``fetch`` overwrites no file of other bytes under its
``--out`` unless ``replace=True``.
"""

from tensorwire.dataset.digest import Digest, DigestService
from tensorwire.dataset.fetch import FetchReport, fetch
from tensorwire.dataset.plan import Plan, make_plan
from tensorwire.dataset.scatter import NodeReport, ScatterReport, scatter
from tensorwire.dataset.shards import ShardDataset

__all__ = [
    "Digest",
    "DigestService",
    "FetchReport",
    "NodeReport",
    "Plan",
    "ScatterReport",
    "ShardDataset",
    "fetch",
    "make_plan",
    "scatter",
]
