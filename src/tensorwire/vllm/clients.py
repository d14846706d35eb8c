"""``Engines``: vLLM's weight-sync control plane over ``LLM`` objects in this process.

vLLM ships clients for its HTTP routes and for Ray actors (``vllm.distributed.weight_transfer.
clients``); a trainer that holds its engines as offline ``LLM`` objects (one process, a test, a
benchmark) uses this one. Each call goes to every engine at once, so several engines update as one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class Engines:
    """The four weight-sync methods a ``TrainerWeightTransferEngine`` calls, over ``llms``: each
    call goes to every engine at once (a thread each) and returns when all have answered; the
    first failure is raised."""

    def __init__(self, llms: Any | Sequence[Any]) -> None:
        self.llms = list(llms) if isinstance(llms, Sequence) else [llms]

    def _each(self, call: Callable[[Any], object]) -> None:
        if len(self.llms) == 1:
            call(self.llms[0])
            return
        with ThreadPoolExecutor(len(self.llms), thread_name_prefix="tensorwire-engines") as pool:
            for future in [pool.submit(call, llm) for llm in self.llms]:
                future.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each(lambda llm: llm.init_weight_transfer_engine({"init_info": init_info}))

    def start_weight_update(self) -> None:
        self._each(lambda llm: llm.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._each(lambda llm: llm.update_weights({"update_info": update_info}))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each(lambda llm: llm.finish_weight_update(weight_version=weight_version))

    def weight_versions(self) -> list[str]:
        """Each engine's weight version, in order."""
        return [str(llm.get_weight_version()) for llm in self.llms]
