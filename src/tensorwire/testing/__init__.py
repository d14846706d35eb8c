"""Public test kit: the transport conformance suite (``tensorwire.testing.conformance``)."""
