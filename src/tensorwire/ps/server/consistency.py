"""The consistency modes of a parameter server: their gates and waits, and how pushes are applied.

* ``sync``: a push is recorded for its clock (ps/server/gradients.py ``pending``); once every live worker
  of the step pushed, the gradients are averaged (summed in worker order, so a run is
  bit-reproducible) and the optimizer steps once (``apply_ready_steps``). A pull for clock t+1
  waits for step t (``gate``). No step is taken before ``world`` workers have joined.
* ``async``: each push is applied as it arrives.
* ``ssp:s``: pushes are applied as they arrive, and a worker pulling at clock c waits while
  c - (slowest live worker's clock) > s.

PS_PUSH (``on_push``) is exactly-once: a push carries (worker, sequence), one push per worker is
received at a time, and a resend of one applied already is answered as the first time, not
applied again. Inside the replica's turn (``Replica.in_order``) a push is replicated, then
applied (``accept``); a backup applies the same push with the same code (``apply_replicated``).

Every wait (``wait``: a pull for a step, a gate, initialisation, a slow pull's room, a barrier)
is bounded by the request's ``wait_ms`` or the server's ``wait_timeout``, and ends in a TIMEOUT
error that names what was waited for and who lags. Waiters sleep on one event that every change of
state sets (``notify``) and replaces; a job that ends (``close``) wakes them with an error.

PS_BARRIER (``barrier``): the worker's arrival at a generation is replicated, then it waits until
the generation is released (ps/server/membership.py: every live worker there, every rank joined).

Steps and gradient sums run on the job's thread (``Job.run``) under the parameters' lock taken
exclusively; the event loop meanwhile goes on receiving the next push.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from tensorwire.compression.codecs import from_wire
from tensorwire.errors import ProtocolError, WaitTimeout, WorkerDropped
from tensorwire.ps.job import Job
from tensorwire.ps.server import replication
from tensorwire.ps.server.gradients import Gradients, Grads, Pending
from tensorwire.ps.server.membership import Member, Members
from tensorwire.ps.server.replica import Replica
from tensorwire.ps.server.state import State
from tensorwire.server.core import Request
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps

log = logging.getLogger("tensorwire.ps")
MAX_STALENESS_BUCKET = 1000  # the histogram's last bucket holds everything above


class Consistency:
    """The modes' gates, waits and steps over one job (see the module doc)."""

    def __init__(
        self,
        job: Job,
        members: Members,
        gradients: Gradients,
        *,
        state: State,
        replica: Replica,
        wait_timeout: float,
    ) -> None:
        self._job = job
        self._members = members
        self._gradients = gradients
        self._state = state
        self._replica = replica
        self.wait_timeout = wait_timeout
        self.duplicates = 0  # resent pushes answered without being applied again
        self.staleness: Counter[int] = Counter()
        self._changed: asyncio.Event | None = None  # set (and dropped) at every change of state
        self._applying: asyncio.Lock | None = None
        self.ended: str | None = None  # why the job ended (then every wait fails at once)

    def close(self, why: str) -> None:
        """The job ended: every waiter gets an error saying so."""
        self.ended = why
        self.notify()

    # -- waiting --------------------------------------------------------------------------------
    async def gate(self, head: wps.PsHead, state: Member) -> None:
        """Hold a worker's pull until its mode lets it read (see the module doc)."""
        mode = self._job.mode
        assert mode is not None
        if mode.kind == "sync":
            await self.wait(lambda: self._job.step >= head.clock, head, f"step {head.clock - 1} to be taken")
        elif mode.kind == "ssp":
            bound = mode.staleness
            await self.wait(
                lambda: head.clock - self._members.slowest() <= bound,
                head,
                f"the slowest worker to come within {bound} clocks of clock {head.clock}",
            )

    async def wait(
        self, ready: Callable[[], bool], head: wps.PsHead, what: str, lagging: Callable[[], str] | None = None
    ) -> None:
        """Until ``ready()``, within the request's wait; ``lagging`` says who is late (default:
        the workers' clocks)."""
        # The peer may ask for a shorter wait, never a longer one than the server's own.
        seconds = min(head.wait_ms / 1000, self.wait_timeout) if head.wait_ms else self.wait_timeout
        try:
            async with asyncio.timeout(seconds):
                while not ready():
                    self.check_open()
                    if self._changed is None:
                        self._changed = asyncio.Event()
                    await self._changed.wait()
        except TimeoutError:
            raise WaitTimeout(f"waited {seconds:.3g}s for {what}; {(lagging or self._who_lags)()}") from None

    def check_open(self) -> None:
        if self.ended is not None:
            raise ProtocolError(f"job {self._job.id!r} ended ({self.ended})")

    async def barrier(self, request: Request, head: wps.PsHead) -> int:
        """PS_BARRIER: note that the worker reached generation ``head.clock`` (replicated), then
        wait until every live worker of the job has; the generation released."""
        state = self._members.member(request, head, head.seq)
        generation, members = head.clock, self._members
        released = members.barrier_released()
        if not 0 < generation <= max(state.barrier, released) + 1:
            raise ProtocolError(
                f"worker {head.worker} asked for barrier {generation}; it is at {state.barrier} and "
                f"the job at {released} (barriers are numbered 1, 2, ... by each worker)"
            )
        if generation > state.barrier:
            async with self._replica.in_order():
                self.check_open()
                await self._replica.replicate(replication.Change.BARRIER, head)
                self.arrive(head.worker, generation)
        with request.waiting():
            await self.wait(
                lambda: members.barrier_released() >= generation,
                head,
                f"barrier {generation} of job {self._job.id!r}",
                lambda: members.not_at_barrier(generation),
            )
        return members.released

    def arrive(self, worker: int, generation: int) -> None:
        """Worker ``worker`` is at barrier ``generation`` (a backup: as its primary said)."""
        self._members.workers[worker].barrier = generation
        self._members.barrier_released()
        self.notify()

    def notify(self) -> None:
        """Wake every waiter to re-check what it waits for (one event per change, then a new one)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _who_lags(self) -> str:
        job, workers = self._job, self._members.workers
        if job.config is None:
            return "no worker has initialised the job"
        live = sorted((w, s.clock) for w, s in workers.items() if s.live)
        clocks = ", ".join(f"worker {w} at clock {clock}" for w, clock in live[:16])
        missing = [w for w in range(min(job.world, len(workers) + 16)) if w not in workers][:16]
        joined = f"; never joined: {', '.join(map(str, missing))}" if missing else ""
        return f"step {job.step}, live: {clocks or 'none'}{joined}"

    # -- pushes ---------------------------------------------------------------------------------
    async def on_push(self, request: Request, head: wps.PsHead) -> None:
        """PS_PUSH of this job (the server checked this replica serves and decoded the head)."""
        metas = wm.decode_records(request.meta)
        codec_name, incarnation = wps.decode_push_tail(request.meta)
        codec = from_wire(codec_name)
        request.meta.done()
        state = self._members.member(request, head, incarnation)
        if state.pushing:  # a resend racing the original (the client timed out): let it finish first
            with request.waiting():
                await self.wait(lambda: not state.pushing, head, f"worker {head.worker}'s push in flight")
            if self._members.workers.get(head.worker) is not state or not state.live:
                raise WorkerDropped(f"worker {head.worker} left or rejoined while its push waited: rejoin")
        if head.seq <= state.seq:  # applied already: answer as the first time, apply nothing
            await request.skip()
            self.duplicates += 1
            log.info("worker %d resent push %d: answered, not applied again", head.worker, head.seq)
            stale = wps.encode_push_reply(self._job.version, 0)
            await request.reply(state.last_reply if head.seq == state.seq else stale)
            return
        self._check_push(head, state)
        shards, present = self._gradients.shards_for(metas, request.header.data_len, codec)
        buffers = self._gradients.take(shards)
        grads = [b if p else None for b, p in zip(buffers, present, strict=True)]
        state.pushing = True  # one push per worker at a time: a second one is refused, not merged
        accepted = False
        try:
            data = await self._gradients.receive(request, codec, grads)
            # The backups' body is the one older releases sent (no incarnation: the primary vouches).
            body = wm.encode_records(metas) + wps.encode_codec(codec.name if codec else None)
            async with self._replica.in_order():
                self.check_open()  # the job may have ended (tensorwire ps end --force) meanwhile
                # Backups get the payloads as they came and decode them with the same code, so
                # they hold the same bits (and replication moves the compressed bytes).
                await self._replica.replicate(replication.Change.PUSH, head, body, data)
                accepted = True
                await self._accept(head, state, buffers, grads)
        finally:
            if not accepted:  # refused or broken: its buffers are kept (and counted) for the next push
                self._gradients.free.append(buffers)
            state.pushing = False
            self.notify()
        await request.reply(state.last_reply)

    async def apply_replicated(self, request: Request, head: wps.PsHead) -> None:
        """A backup applies its primary's push (PUSH change), as the primary did."""
        metas = wm.decode_records(request.meta)
        codec = from_wire(wps.decode_codec(request.meta))
        state = self._members.workers[head.worker]
        shards, present = self._gradients.shards_for(metas, request.header.data_len, codec)
        buffers = self._gradients.take(shards)
        grads = [b if p else None for b, p in zip(buffers, present, strict=True)]
        await self._gradients.receive(request, codec, grads)
        await self._accept(head, state, buffers, grads)

    def _check_push(self, head: wps.PsHead, state: Member) -> None:
        config = self._job.config
        if config is None:
            raise ProtocolError("PS_PUSH before the job was initialised (PS_INIT)")
        if head.seq != state.seq + 1:
            raise ProtocolError(f"worker {head.worker} sent push {head.seq} after push {state.seq}")
        if head.clock != state.clock:
            raise ProtocolError(
                f"worker {head.worker} pushed for clock {head.clock}; it is at clock {state.clock}"
            )
        mode = config.mode
        if mode.kind == "ssp" and head.clock - state.read_clock > mode.staleness:
            raise ProtocolError(
                f"worker {head.worker} pushed for clock {head.clock} on parameters read at clock "
                f"{state.read_clock}: staler than {mode} allows (pull first)"
            )
        if mode.kind == "sync" and head.clock != self._job.step:
            # Behind: that step is taken. Ahead: it never pulled the step before (and gradients
            # held for future steps would pile up without bound).
            raise ProtocolError(f"worker {head.worker} pushed for step {head.clock}; the server is at step "
                                f"{self._job.step} (pull before pushing again)")  # fmt: skip

    async def _accept(self, head: wps.PsHead, state: Member, buffers: Grads, grads: Grads) -> None:
        """Record (sync) or apply (async, ssp) a received push; then the worker's clock moves on,
        so an ssp gate opens only once the update it waits for is in the parameters."""
        assert self._job.config is not None
        if self._job.config.mode.kind == "sync":
            self._gradients.pending.setdefault(head.clock, Pending()).grads[head.worker] = (buffers, grads)
            self._record(0)
            self._mark(head, state, 0)
            await self.apply_ready_steps()
            return
        staleness = self._staleness_of(head, state)
        await self._apply(grads, pushes=1)
        self._gradients.free.append(buffers)
        self._record(staleness)
        self._mark(head, state, staleness)
        await self._state.maybe_checkpoint()

    def _mark(self, head: wps.PsHead, state: Member, staleness: int) -> None:
        """The push is in: the worker's clock moves on and its sequence number is remembered."""
        state.clock = head.clock + 1
        state.seq = head.seq
        state.last_reply = wps.encode_push_reply(self._job.version, staleness)
        self.notify()

    def _staleness_of(self, head: wps.PsHead, state: Member) -> int:
        """Clocks the push's parameters may lag the slowest worker's updates by: the pull before
        it noted the slowest live clock (``read_clock``). ``sync`` always 0, ``ssp:s`` never more
        than s (its pull gate guarantees it), ``async`` whatever happens."""
        if self._job.config is None or self._job.config.mode.kind == "sync":
            return 0
        return head.clock - state.read_clock

    def _record(self, staleness: int) -> None:
        self.staleness[min(staleness, MAX_STALENESS_BUCKET)] += 1

    # -- applying -------------------------------------------------------------------------------
    async def leave(self, worker: int, why: str, *, final: bool = False) -> None:
        """``worker`` is no longer live (``final``: for good): a sync step waiting only for it is
        taken now."""
        self._members.left(worker, why, final=final)
        self.notify()
        await self.apply_ready_steps()

    async def apply_ready_steps(self) -> None:
        """Take every sync step whose gradients are all in (there may be several after a leave)."""
        job = self._job
        async with self.step_lock():
            while (ready := self._ready_step()) is not None:
                del self._gradients.pending[job.step]
                mean = await job.run(_mean, [grads for _, grads in ready])
                await self._apply(mean, pushes=len(ready))
                self._gradients.free.extend(buffers for buffers, _ in ready)
                job.step += 1
                self.notify()
                await self._state.maybe_checkpoint()

    async def skip_step(self, step: int) -> None:
        """Take sync step ``step`` empty (PS_ROLLBACK one step forward, ps/server/lifecycle.py):
        its pushes, if some arrived, are dropped, and no update is applied, as when every worker
        of a step is dropped; the step and version move on, so that this server is at the others'
        step again. Nothing, if the job is past ``step`` by the time the step lock is held (the
        request was checked before it waited for its turn)."""
        job = self._job
        async with self.step_lock():
            if job.step != step:
                return
            pending = self._gradients.pending.pop(job.step, None)
            if pending is not None:
                self._gradients.free.extend(buffers for buffers, _ in pending.grads.values())
            job.version += 1
            job.step += 1
            self.notify()
        log.warning("job %s: step %d taken empty (its pushes were lost here), to meet its other servers",
                    job.id, job.step - 1)  # fmt: skip

    def step_lock(self) -> asyncio.Lock:
        """Held while sync steps are taken: a join waits, so a step being taken does not count it."""
        if self._applying is None:
            self._applying = asyncio.Lock()
        return self._applying

    def _ready_step(self) -> list[tuple[Grads, Grads]] | None:
        """The pushes of the current step in worker order, if every live worker pushed."""
        job, workers = self._job, self._members.workers
        pending = self._gradients.pending.get(job.step)
        if pending is None or len(workers) < job.world:
            return None
        # Every live worker of this step pushed (one that joined for the next step is not in it).
        if any(w not in pending.grads for w in self._members.live() if workers[w].clock <= job.step):
            return None
        return [pending.grads[w] for w in sorted(pending.grads)]

    async def _apply(self, grads: Grads, pushes: int) -> None:
        """One optimizer step with ``grads`` (one per shard, None where there is none)."""
        job = self._job
        assert job.optimizer is not None
        shards = list(job.shards.values())
        async with job.lock.exclusive():
            await job.run(_step, job.optimizer, [s.param for s in shards], grads)
        job.version += 1
        job.pushes += pushes
        for shard, grad in zip(shards, grads, strict=True):
            if grad is not None:
                shard.version = job.version


def _mean(pushes: Sequence[Grads]) -> Grads:
    """Per shard, the sum of the workers' gradients in worker order (into the first one's buffer),
    divided by the number of workers: a worker without a gradient for a shard counts as zeros,
    as in one process whose batch is all the workers' batches. None where nobody had one."""
    mean: Grads = []
    for column in zip(*pushes, strict=True):
        present = [g for g in column if g is not None]
        if not present:
            mean.append(None)
            continue
        total = present[0]
        for grad in present[1:]:
            total.add_(grad)
        if len(pushes) > 1:
            total.div_(len(pushes))
        mean.append(total)
    return mean


def _step(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], grads: Grads) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad  # None: torch.optim leaves the parameter (and its state) alone
    optimizer.step()
    for param in params:
        param.grad = None
