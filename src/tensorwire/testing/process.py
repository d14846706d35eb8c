"""Real server processes for integration and fault tests: ``tensorwire.server.process``, kept here
as part of the public test kit."""

from tensorwire.server.process import ServerProcess, run_threads, wait_for

__all__ = ["ServerProcess", "run_threads", "wait_for"]
