"""Public test kit: the transport conformance suite (``tensorwire.testing.conformance``), fault
schedules and a faulty proxy (``faults``), and real server processes (``process``)."""
