"""A communicator for libmtrain (the table of include/mtrain/mtrain_comm.h)
whose operations call torch.distributed on a process group.

The table's slots are ctypes callbacks; the state pointer is an integer key
into this module's registry. Buffers are host memory (memory_space HOST), so
the group must move CPU tensors: gloo. Every transfer runs on a private
tensor (a copy of the library's buffer), so that a transfer abandoned after a
timeout never touches the library's memory later.

Timeouts: every wait gives up after MTRAIN_COMM_TIMEOUT seconds (default
300) with MTRAIN_ERR_TIMEOUT naming the peer (point-to-point) or the
collective; any torch.distributed error becomes MTRAIN_ERR_COMM with its
text. After either, the communicator is broken: its later calls fail at once
naming the first error (the ranks are out of step).

split() makes sub-communicators over the same group: their point-to-point
messages travel on the group with their own tag range, and their
collectives are gathered through their first rank by point-to-point.
"""

from __future__ import annotations

import ctypes
import datetime
import itertools
import os
import threading
from typing import Any

import torch
import torch.distributed as dist

from . import _lib as L
from ._nccl import NcclComm
from .errors import MtrainError

DEFAULT_TIMEOUT = 300.0
# Point-to-point tags on the group are offset far above small numbers, so that
# mtrain's messages never share a tag with other point-to-point traffic of the
# caller on the same group (which typically uses small tags).
_TAG_BASE = 1 << 30
_TAG_SPAN = 1 << 30  # the group's communicator: tags [base, base + span)
_SPLITS = 64  # a communicator's span holds 63 sub-communicators' spans
_TAG_GATHER = L.TAG_USER + 1
_TAG_SCATTER = L.TAG_USER + 2


def default_timeout() -> float:
    env = os.environ.get("MTRAIN_COMM_TIMEOUT", "")
    if not env:
        return DEFAULT_TIMEOUT
    try:
        value = float(env)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise L.fail(
            L.ERR_INVALID_CONFIG,
            f"environment variable MTRAIN_COMM_TIMEOUT={env!r} is not a positive number of seconds",
        )
    return value


_groups: dict[str, Any] = {}


def register_group(group: Any) -> str:
    """The name by which the ops find `group` (a torch.distributed ProcessGroup)."""
    if not dist.is_available() or not dist.is_initialized():
        raise L.fail(
            L.ERR_INVALID_CONFIG, "group= needs torch.distributed initialised (init_process_group)"
        )
    name = str(group.group_name)
    _groups[name] = group
    return name


def _group(name: str) -> Any:
    g = _groups.get(name)
    if g is None:
        raise L.fail(
            L.ERR_INVALID_ARGUMENT,
            f"process group {name!r} is not known to mtrain (pass group= to mtrain.attention, "
            "mtrain.estimate_pattern or mtrain.dispatch)",
        )
    return g


class _Request:
    __slots__ = ("bytes", "dest", "is_send", "peer", "tag", "tensor", "work")

    def __init__(
        self, work: Any, tensor: torch.Tensor, dest: int, nbytes: int, peer: int, tag: int,
        is_send: bool,
    ) -> None:  # fmt: skip
        self.work, self.tensor, self.dest, self.bytes = work, tensor, dest, nbytes
        self.peer, self.tag, self.is_send = peer, tag, is_send


class TorchComm:
    """One communicator: ranks `members` (global ranks) of `group`."""

    def __init__(
        self,
        group: Any,
        members: list[int],
        tags: tuple[int, int],
        name: str,
        timeout: float,
    ) -> None:
        self.group = group
        self.members = members
        self.tag_base, self.tag_span = tags
        self.name = name
        self.timeout = timeout
        me = dist.get_rank()
        self.rank = members.index(me)
        self.size = len(members)
        self.is_whole_group = self.tag_base == _TAG_BASE
        self.broken = ""
        self.splits = 0
        self.requests: dict[int, _Request] = {}
        self.abandoned: list[Any] = []  # transfers given up after a timeout, kept alive
        self.key = next(_keys)
        _states[self.key] = self
        self.ops = _ops_table()
        self.struct = L.Comm(ops=ctypes.pointer(self.ops), state=self.key)

    # ---- helpers ----

    def handle(self) -> ctypes.c_void_p:
        """The mtrain_comm_t * the library takes (this object's table)."""
        return ctypes.cast(ctypes.pointer(self.struct), ctypes.c_void_p)

    def _usable(self, what: str) -> None:
        if self.broken:
            raise L.fail(
                L.ERR_COMM,
                f"rank {self.rank}: {what} on the torch communicator refused: it is unusable "
                f"after an earlier error ({self.broken})",
            )

    def _break(self, err: MtrainError) -> MtrainError:
        if not self.broken:
            self.broken = err.message
        return err

    def _wait(self, work: Any, what: str, peer: int | None) -> None:
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise self._break(self._timeout(what, peer)) from e
            raise self._break(L.fail(L.ERR_COMM, f"rank {self.rank}: {what} failed: {text}")) from e
        if ok is False:
            raise self._break(self._timeout(what, peer))

    def _timeout(self, what: str, peer: int | None) -> MtrainError:
        if peer is not None:
            return L.fail(
                L.ERR_TIMEOUT,
                f"rank {self.rank}: {what} did not complete within {self.timeout:.1f} s "
                f"(rank {peer} died or stopped answering)",
            )
        return L.fail(
            L.ERR_TIMEOUT,
            f"rank {self.rank}: {what} did not complete within {self.timeout:.1f} s (a rank "
            "died or stopped answering)",
        )

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size:
            raise L.fail(
                L.ERR_INVALID_ARGUMENT, f"torch {what}: peer {peer} out of range [0, {self.size})"
            )

    # ---- point-to-point ----

    def post(self, buf: int, nbytes: int, peer: int, tag: int, is_send: bool) -> int:
        what = "a send" if is_send else "a receive"
        self._usable(what)
        self._check_peer(peer, what)
        t = torch.empty(nbytes, dtype=torch.uint8)
        if is_send and nbytes:
            ctypes.memmove(t.data_ptr(), buf, nbytes)
        work = None
        if nbytes:
            gtag = self.tag_base + tag
            dst = self.members[peer]
            try:
                if is_send:
                    work = dist.isend(t, dst=dst, group=self.group, tag=gtag)
                else:
                    work = dist.irecv(t, src=dst, group=self.group, tag=gtag)
            except RuntimeError as e:
                raise self._break(
                    L.fail(L.ERR_COMM, f"rank {self.rank}: posting {what} to rank {peer}: {e}")
                ) from e
        h = next(_keys)
        self.requests[h] = _Request(work, t, 0 if is_send else buf, nbytes, peer, tag, is_send)
        return h

    def wait(self, h: int) -> None:
        req = self.requests.pop(h, None)
        if req is None:
            raise L.fail(L.ERR_INTERNAL, f"torch communicator: unknown request {h}")
        what = (
            f"{'a send to' if req.is_send else 'a receive from'} rank {req.peer} "
            f"(tag {req.tag}, {req.bytes} bytes)"
        )
        if self.broken:
            if req.work is not None:
                self.abandoned.append((req.work, req.tensor))
            self._usable("waiting for " + what)
        if req.work is not None:
            try:
                self._wait(req.work, what, req.peer)
            except MtrainError:
                self.abandoned.append((req.work, req.tensor))
                raise
        if not req.is_send and req.bytes:
            ctypes.memmove(req.dest, req.tensor.data_ptr(), req.bytes)

    # ---- collectives ----

    def allreduce(self, buf: int, count: int, dtype: int, op: int) -> None:
        self._usable("an all-reduce")
        if dtype not in (L.F32, L.F64):
            raise L.fail(L.ERR_UNSUPPORTED_DTYPE, f"torch allreduce: dtype {dtype} not supported")
        kind = _KIND_MAX if op == L.REDUCE_MAX else _KIND_SUM
        self._agree(kind, count, dtype)
        if count <= 0:
            return
        tdt = torch.float32 if dtype == L.F32 else torch.float64
        t = torch.empty(count, dtype=tdt)
        nbytes = count * t.element_size()
        ctypes.memmove(t.data_ptr(), buf, nbytes)
        what = _describe(kind, count, dtype)
        if self.is_whole_group:
            rop = dist.ReduceOp.MAX if op == L.REDUCE_MAX else dist.ReduceOp.SUM
            work = self._collective(
                lambda: dist.all_reduce(t, rop, self.group, async_op=True), what
            )
            self._finish(work, t, what)
        else:
            parts = self._gather_all(t.view(torch.uint8)).view(tdt).view(self.size, count)
            # fixed order (rank 0, 1, ...): the same bits on every rank
            res = parts[0].clone()
            for r in range(1, self.size):
                res = torch.maximum(res, parts[r]) if op == L.REDUCE_MAX else res + parts[r]
            t = res
        ctypes.memmove(buf, t.data_ptr(), nbytes)

    def allgather(self, send: int, recv: int, nbytes: int) -> None:
        self._usable("an all-gather")
        self._agree(_KIND_GATHER, nbytes, 0)
        if nbytes == 0:
            return
        t = torch.empty(nbytes, dtype=torch.uint8)
        ctypes.memmove(t.data_ptr(), send, nbytes)
        what = _describe(_KIND_GATHER, nbytes, 0)
        out = self._gather_bytes(t, what)
        ctypes.memmove(recv, out.data_ptr(), self.size * nbytes)

    def barrier(self) -> None:
        self._usable("a barrier")
        self._agree(_KIND_BARRIER, 0, 0)

    def _gather_bytes(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """All-gather of a uint8 tensor: [size * n] in rank order."""
        if not self.is_whole_group:
            return self._gather_all(t)
        n = t.numel()
        out = torch.empty(self.size * n, dtype=torch.uint8)
        views = list(out.view(self.size, n).unbind(0))
        work = self._collective(lambda: dist.all_gather(views, t, self.group, async_op=True), what)
        self._finish(work, (out, t), what)
        return out

    def agree_context(self, digest: bytes, cached: bool) -> tuple[bool, bool]:
        """Collective (Python side, before a call that uses a context): whether
        every rank asks for the same context configuration (digest), and
        whether every rank has it already."""
        self._usable("a context check")
        self._agree(_KIND_CONTEXT, len(digest), 0)
        mine = torch.frombuffer(bytearray(digest + bytes([1 if cached else 0])), dtype=torch.uint8)
        rows = self._gather_bytes(mine.clone(), "a context check").view(self.size, -1)
        same = bool((rows[:, :-1] == rows[self.rank, :-1]).all())
        return same, bool((rows[:, -1] == 1).all())

    def _agree(self, kind: int, count: int, dtype: int) -> None:
        """Every rank must run the same collective on the same size: a header
        of fixed size is compared first, so that ranks out of step get an
        error (gloo ends the process on a size mismatch)."""
        mine = torch.tensor([kind, count, dtype], dtype=torch.int64)
        allv = self._gather_bytes(mine.view(torch.uint8), "a collective's header")
        rows = allv.view(torch.int64).view(self.size, 3).tolist()
        for r, row in enumerate(rows):
            if row != rows[self.rank]:
                raise self._break(
                    L.fail(
                        L.ERR_COMM,
                        f"rank {self.rank}: the ranks are out of step: this rank runs "
                        f"{_describe(*rows[self.rank])} while rank {r} runs {_describe(*row)} "
                        "(the ranks must make the same calls with the same options and batch)",
                    )
                )

    def _collective(self, start: Any, what: str) -> Any:
        try:
            return start()
        except RuntimeError as e:
            raise self._break(L.fail(L.ERR_COMM, f"rank {self.rank}: {what}: {e}")) from e

    def _finish(self, work: Any, keep: Any, what: str) -> None:
        try:
            self._wait(work, what, None)
        except MtrainError:
            self.abandoned.append((work, keep))
            raise

    def _gather_all(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather of a uint8 tensor through rank 0 of this communicator by
        point-to-point (for sub-communicators)."""
        n = t.numel()
        out = torch.empty(self.size * n, dtype=torch.uint8)
        if self.rank == 0:
            out[:n] = t
            for r in range(1, self.size):
                h = self.post(out[r * n :].data_ptr(), n, r, _TAG_GATHER, False)
                self.wait(h)
            hs = [
                self.post(out.data_ptr(), out.numel(), r, _TAG_SCATTER, True)
                for r in range(1, self.size)
            ]
            for h in hs:
                self.wait(h)
        else:
            self.wait(self.post(t.data_ptr(), n, 0, _TAG_GATHER, True))
            self.wait(self.post(out.data_ptr(), out.numel(), 0, _TAG_SCATTER, False))
        return out

    def split(self, color: int, key: int) -> TorchComm:
        self._usable("a split")
        mine = torch.tensor([color, key], dtype=torch.int64)
        allv = torch.empty(2 * self.size, dtype=torch.int64)
        self.allgather(mine.data_ptr(), allv.data_ptr(), 16)
        pairs = allv.view(self.size, 2).tolist()
        self.splits += 1
        span = self.tag_span // _SPLITS
        if self.splits >= _SPLITS or span <= _TAG_SCATTER:
            raise L.fail(
                L.ERR_NOT_SUPPORTED,
                f"torch communicator {self.name}: no tag range left for another split "
                f"({self.splits - 1} splits, span {self.tag_span})",
            )
        tags = (self.tag_base + self.splits * span, span)
        ranks = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
        members = [self.members[r] for _, r in ranks]
        return TorchComm(self.group, members, tags, f"{self.name}/split{self.splits}", self.timeout)


_KIND_SUM, _KIND_MAX, _KIND_GATHER, _KIND_BARRIER, _KIND_CONTEXT = 1, 2, 3, 4, 5


def _describe(kind: int, count: int, dtype: int) -> str:
    if kind == _KIND_GATHER:
        return f"an all-gather of {count} bytes per rank"
    if kind == _KIND_BARRIER:
        return "a barrier"
    if kind == _KIND_CONTEXT:
        return "the check of a call's context (mtrain's Python layer)"
    name = "fp32" if dtype == L.F32 else "fp64"
    return f"an all-reduce ({'max' if kind == _KIND_MAX else 'sum'} of {count} {name} values)"


_keys = itertools.count(1)
_states: dict[int, TorchComm] = {}
_comms: dict[tuple[str, str], TorchComm | NcclComm] = {}
_comm_lock = threading.Lock()


def communicator(name: str, device: torch.device) -> TorchComm | NcclComm:
    """The communicator of a registered group (one per group and device
    type): CPU tensors on a gloo group, this module's torch communicator;
    CUDA tensors on an NCCL group, libmtrain's NCCL communicator
    bootstrapped through the group (_nccl.py)."""
    group = _group(name)
    backend = str(dist.get_backend(group))
    if device.type == "cuda":
        if "nccl" not in backend:
            raise L.fail(
                L.ERR_NOT_SUPPORTED,
                f"CUDA tensors on a process group of backend {backend!r}: context parallel on "
                "GPUs needs an NCCL group (init_process_group('nccl')); CPU tensors on a gloo "
                "group run the CPU ring",
            )
        with _comm_lock:
            key = (name, f"cuda:{device.index}")
            c = _comms.get(key)
            if c is None:
                c = NcclComm(group, name, device, default_timeout())
                _comms[key] = c
            return c
    if "gloo" not in backend:
        raise L.fail(
            L.ERR_NOT_SUPPORTED,
            f"CPU tensors on a process group of backend {backend!r}: mtrain's torch communicator "
            "moves host memory through gloo (init_process_group('gloo'), or 'cpu:gloo,cuda:nccl'); "
            "CUDA tensors on an NCCL group use mtrain's NCCL communicator",
        )
    with _comm_lock:
        c = _comms.get((name, device.type))
        if c is None:
            size = dist.get_world_size(group)
            members = [dist.get_global_rank(group, r) for r in range(size)]
            c = TorchComm(
                group, members, (_TAG_BASE, _TAG_SPAN), f"torch:{name}", default_timeout()
            )
            _comms[(name, device.type)] = c
        assert isinstance(c, TorchComm)
        return c


def reset() -> None:
    _comms.clear()
    _groups.clear()


# ---- the C table: callbacks dispatching on the state key ----


def _guard(fn: Any) -> Any:
    """Runs fn; returns 0 or sets mtrain's last error and returns its status.
    No exception may cross into C."""

    def run(*args: Any) -> int:
        try:
            fn(*args)
            return L.SUCCESS
        except MtrainError as e:
            return L.set_error(e.code, e.message)
        except BaseException as e:
            return L.set_error(L.ERR_COMM, f"torch communicator: {type(e).__name__}: {e}")

    return run


def _state(key: int | None) -> TorchComm:
    s = _states.get(key or 0)
    if s is None:
        raise L.fail(L.ERR_INTERNAL, f"torch communicator: unknown state {key}")
    return s


def _rank(key: int | None) -> int:
    s = _states.get(key or 0)
    return s.rank if s else 0


def _size(key: int | None) -> int:
    s = _states.get(key or 0)
    return s.size if s else 1


def _isend(key: int | None, buf: int | None, n: int, peer: int, tag: int, out: Any) -> None:
    out[0] = _state(key).post(buf or 0, n, peer, tag, True)


def _irecv(key: int | None, buf: int | None, n: int, peer: int, tag: int, out: Any) -> None:
    out[0] = _state(key).post(buf or 0, n, peer, tag, False)


def _wait_cb(key: int | None, req: int | None) -> None:
    if req:
        _state(key).wait(req)


def _allreduce(key: int | None, buf: int | None, count: int, dtype: int, op: int) -> None:
    _state(key).allreduce(buf or 0, count, dtype, op)


def _allgather(key: int | None, send: int | None, recv: int | None, n: int) -> None:
    _state(key).allgather(send or 0, recv or 0, n)


def _barrier(key: int | None) -> None:
    _state(key).barrier()


def _split(key: int | None, color: int, k: int, out: Any) -> None:
    sub = _state(key).split(color, k)
    # mtrain_comm_destroy free()s the struct: it must come from malloc
    mem = _libc().malloc(ctypes.sizeof(L.Comm))
    if not mem:
        raise L.fail(L.ERR_OUT_OF_MEMORY, "torch communicator: out of memory")
    c = L.Comm.from_address(mem)
    c.ops = ctypes.pointer(sub.ops)
    c.state = sub.key
    out[0] = mem


def _abort(key: int | None, code: int) -> None:
    s = _states.get(key or 0)
    if s is not None and not s.broken:
        s.broken = f"aborted with code {code}"


def _destroy(key: int | None) -> None:
    _states.pop(key or 0, None)


_libc_handle: Any = None


def _libc() -> Any:
    global _libc_handle  # noqa: PLW0603 -- loaded once
    if _libc_handle is None:
        _libc_handle = ctypes.CDLL(None)
        _libc_handle.malloc.restype = ctypes.c_void_p
        _libc_handle.malloc.argtypes = [ctypes.c_size_t]
    return _libc_handle


_table: L.CommOps | None = None
_callbacks: list[Any] = []


def _ops_table() -> L.CommOps:
    """The one table of callbacks (kept alive for the process)."""
    global _table  # noqa: PLW0603 -- built once
    if _table is None:
        cbs = [
            L.RANK_FN(_rank),
            L.RANK_FN(_size),
            L.ISEND_FN(_guard(_isend)),
            L.ISEND_FN(_guard(_irecv)),
            L.WAIT_FN(_guard(_wait_cb)),
            L.ALLREDUCE_FN(_guard(_allreduce)),
            L.ALLGATHER_FN(_guard(_allgather)),
            L.BARRIER_FN(_guard(_barrier)),
            L.SPLIT_FN(_guard(_split)),
            L.ABORT_FN(_abort),
            L.DESTROY_FN(_destroy),
        ]
        _callbacks.extend(cbs)
        _table = L.CommOps(
            api_version=L.API_VERSION,
            name=b"torch",
            memory_space=L.MEMORY_HOST,
            rank=cbs[0],
            size=cbs[1],
            isend=cbs[2],
            irecv=cbs[3],
            wait=cbs[4],
            allreduce=cbs[5],
            allgather=cbs[6],
            barrier=cbs[7],
            split=cbs[8],
            set_data_stream=L.SET_STREAM_FN(),
            abort=cbs[9],
            destroy=cbs[10],
        )
    return _table
