"""What the store's operations read off a request and write into an answer (store_ops.py): the
checks every GET and PUT makes of its frame and metadata, the same from the session's task and
from the loop's readiness callback, and a GET answer's records."""

from __future__ import annotations

from tensorwire.errors import InvalidTensor, ProtocolError
from tensorwire.server.request import Request, opname
from tensorwire.store import Entry
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import Opcode

# The longest record an entry keeps (``answer_records``): a name of ~70 bytes with 4 dims, well inside
# the ~400 bytes of ``ENTRY_OVERHEAD`` that an entry's measured objects leave unused.
RECORD_KEPT_BYTES = 128


def no_data(req: Request) -> None:
    if req.header.data_len:
        name = opname(req.header.opcode)
        raise ProtocolError(f"{name} carries no data, but the frame has {req.header.data_len} bytes")


def answer_records(entries: list[Entry]) -> bytes:
    """A GET answer's records. A short record is kept on its entry, encoded on the first read:
    encoding the same record again was a tenth of the server's time in a stream of 1 KiB gets. A
    long one (a long name, many dims: up to ~1.3 KiB) is encoded each time, since what an entry
    holds beyond its bytes must fit the ``ENTRY_OVERHEAD`` its name is charged."""
    for entry in entries:
        if not entry.record:
            record = wm.encode_record(entry.meta)
            if len(record) > RECORD_KEPT_BYTES:
                return wm.encode_records([e.meta for e in entries])
            entry.record = record
    return wm.join_records([e.record for e in entries])


def one_record(req: Request) -> TensorMeta:
    """A PUT's one record, its size checked against the frame's data section."""
    reader = req.meta
    count = reader.peek_count()
    if count != 1:  # before a record is decoded: 100,000 of them would stall the loop
        raise ProtocolError(f"PUT cannot carry {count} tensors")
    metas = wm.decode_records(reader)
    reader.done()
    if metas[0].nbytes != req.header.data_len:
        raise InvalidTensor("the tensor records' sizes do not add up to the frame's data length")
    return metas[0]


def check_names(op: int, names: list[str]) -> None:
    if not names or (op == Opcode.GET and len(names) != 1):
        raise ProtocolError(f"{opname(op)} cannot ask for {len(names)} tensors")
    if len(names) > 1 and len(set(names)) != len(names):  # 100,000 times one small tensor is not a GET
        raise ProtocolError(f"{opname(op)} names the same tensor twice")


def names_of(reader: wm.MetaReader) -> list[str]:
    names = wm.decode_names(reader)
    reader.done()
    return names
