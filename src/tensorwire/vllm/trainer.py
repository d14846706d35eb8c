"""The trainer side: a vLLM ``TrainerWeightTransferEngine`` that publishes each update as one
generation of a tensorwire prefix and has the engines apply it (backend name ``tensorwire``).

``send_weights`` runs on every trainer rank: each publishes its part of the generation
(publisher.py); rank 0, the sender, then drives the engines through vLLM's control plane
(``start_weight_update``, ``update_weights`` naming the generation, ``finish_weight_update`` with
its version). The engines read the generation themselves (relay, deltas), so the trainer's link
carries the model about once whatever the number of engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from tensorwire.errors import WeightUpdateFailed
from tensorwire.security import TlsFiles
from tensorwire.vllm.plugin import register
from tensorwire.vllm.publisher import PublisherOptions, WeightPublisher


@dataclass
class TensorwireTrainerInitInfo(TrainerInitInfo):
    """``url``: the store the trainer publishes to; ``engine_url``: where the engines reach it
    (default: ``url``); ``prefix``: the weights' prefix. ``world_size``/``run_id``: with several
    trainer ranks, each publishes a part (``run_id`` the same on all). ``relay``, ``deltas``,
    ``verify``, ``timeout``, ``prefetch``: the engines' reading (``ReaderOptions``). ``token``/``tls``: the
    trainer's own credentials (the engines use those of their hosts)."""

    backend: ClassVar[str] = "tensorwire"

    url: str = ""
    prefix: str = ""
    engine_url: str = ""
    world_size: int = 1
    run_id: str = ""
    relay: bool = True
    deltas: bool = True
    verify: bool = False
    timeout: float = 120.0
    prefetch: bool = True
    part_timeout: float = 300.0
    token: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None


class TensorwireTrainerWeightTransferEngine(TrainerWeightTransferEngine[TensorwireTrainerInitInfo]):
    """Publishes the source's weights and has the engines apply them; see the module docstring."""

    init_info_cls = TensorwireTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None, is_sender: bool = True
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.publisher: WeightPublisher | None = None
        self.generation = 0  # the last generation the engines applied

    @classmethod
    def trainer_init(
        cls,
        init_info: TensorwireTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if not init_info.url or not init_info.prefix:
            raise ValueError("tensorwire needs url= (the store) and prefix= (the weights' prefix)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.publisher = WeightPublisher(
            PublisherOptions(
                init_info.url, init_info.prefix, token=init_info.token, tls=init_info.tls,
                rank=init_info.rank, world_size=init_info.world_size, run_id=init_info.run_id,
                timeout=init_info.timeout, part_timeout=init_info.part_timeout,
            )
        )  # fmt: skip
        if engine.is_sender:
            client.init_weight_transfer_engine(_engine_init(init_info))
        return engine

    def send_weights(self, version: str | None = None) -> int:
        """Publish the source's weights as one generation and have the engines apply it; its
        version is ``version`` (default: the generation's number). Returns the generation.
        WeightUpdateFailed if the engines could not apply it (they keep their previous version).
        The engines start reading as the generation is published; the update call waits for the
        rest of the read, then applies. To keep them serving for the read too, ``publish`` now
        and ``apply`` later (the next step of an asynchronous RL loop, say)."""
        generation = self.publish(version)
        if self.is_sender:
            self.apply(generation, version or str(generation))
        self.generation = generation
        return generation

    def publish(self, version: str | None = None) -> int:
        """Publish the source's weights (this rank's part of them) as one generation, without
        asking the engines to apply it: they read it meanwhile (prefetch). Returns its number."""
        if self.source is None or self.publisher is None:
            raise RuntimeError("tensorwire: trainer_init with a source= first")
        held = self.source.held_names()
        names = [m.name for m in self.source.metadata()]
        mine = self.publisher.mine(names, held)
        weights = ((n, t) for n, t in self.source if t is not None and n in mine)
        return self.publisher.publish(weights, version).number

    def apply(self, generation: int, version: str | None = None) -> None:
        """Have the engines apply ``generation`` (published already) as ``version`` (default: the
        generation's number); on the sender only. WeightUpdateFailed if they could not."""
        version = version or str(generation)
        self.client.start_weight_update()
        try:
            self.client.update_weights({"generation": generation})
        except Exception as exc:
            raise WeightUpdateFailed(
                f"the engines did not apply generation {generation} ({exc}); they keep serving their "
                "previous version",
                generation=generation, serving="previous",
            ) from exc  # fmt: skip
        self.client.finish_weight_update(weight_version=version)

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


def _engine_init(info: TensorwireTrainerInitInfo) -> dict[str, Any]:
    """The engines' init info (engine.TensorwireInitInfo's fields) from the trainer's."""
    init: dict[str, Any] = {
        "url": info.engine_url or info.url, "prefix": info.prefix, "relay": info.relay,
        "deltas": info.deltas, "verify": info.verify, "timeout": info.timeout, "prefetch": info.prefetch,
    }  # fmt: skip
    if info.tls is not None and info.tls.ca is not None:
        init["tls_ca"] = str(info.tls.ca)
    return init


# A trainer's process starts no engine that would load vLLM's plugins: whoever imports this module
# (``TensorwireTrainerInitInfo`` lives here) has the backend registered.
register()
