"""The wire format: bytes in, bytes out, no sockets (docs/protocol.md is its spec)."""
