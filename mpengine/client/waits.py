"""How a call waits: every call is written once, as *steps*, and ``Client`` blocks on them
where ``AsyncClient`` awaits them.

Steps are a generator with no I/O of its own. It yields *waits*, functions of no arguments
(``Inbox.get`` or ``AsyncInbox.get`` bound to a deadline, a prompt's tokenization...), and
is sent what each came to; it returns the call's result. A stream's steps also yield
``Emit(value)``: a value for the caller. ``Client`` calls each wait; ``AsyncClient`` awaits
what the wait returns (a coroutine from its inbox, or its off-the-loop tokenization).

``call`` and ``streams`` mark a ``Calls`` method written as steps; ``blocking`` and
``awaiting`` make of it ``Client``'s method and ``AsyncClient``'s. Steps that stop early (an
error, a timeout, a stream closed, a cancellation) are closed, which runs their ``finally``:
what they submitted is aborted, the same way for both clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import queue
import sys
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterator,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from mpengine.client.connection import Sink
from mpengine.client.sockets import Deadline

P = ParamSpec("P")
T = TypeVar("T")


class Blocking:
    """Marks the facade whose calls block (``Client``): what type checkers see of its
    methods."""


class Awaiting:
    """Marks the facade whose calls are awaited (``AsyncClient``)."""


Wait = Callable[[], Any]  # called (Client), or called and its result awaited (AsyncClient)


@dataclass(frozen=True, slots=True)
class Emit(Generic[T]):
    """What a stream's steps hand to their caller."""

    value: T


# Yield waits, are sent what each came to, return the call's result.
Steps = Generator[Wait, Any, T]
# Yield waits and emit values, return nothing.
StreamSteps = Generator[Wait | Emit[T], Any, None]


class Inbox:
    """Where the I/O thread puts one call's events, and ``Client`` blocks for them."""

    def __init__(self) -> None:
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self.put: Sink = self._items.put

    def get(self, deadline: Deadline, what: str) -> Any:
        try:
            return self._items.get(timeout=deadline.remaining())
        except queue.Empty:
            raise deadline.error(what) from None


class AsyncInbox:
    """``Inbox`` on the event loop the call was made from (putting into it from the I/O
    thread raises ``RuntimeError`` once the loop is closed, which makes the I/O thread drop
    and abort the request)."""

    def __init__(self) -> None:
        self._items: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.put: Sink = lambda item: loop.call_soon_threadsafe(self._items.put_nowait, item)

    async def get(self, deadline: Deadline, what: str) -> Any:
        remaining = deadline.remaining()
        if remaining is None:
            return await self._items.get()
        try:
            if sys.version_info >= (3, 11):
                # (wait_for before 3.12 loses a cancellation of the caller that comes in the
                # loop turn its awaitable finishes in: the caller then ran on to the end.)
                async with asyncio.timeout(remaining):
                    return await self._items.get()
            return await asyncio.wait_for(self._items.get(), remaining)
        except asyncio.TimeoutError:
            raise deadline.error(what) from None


# -- driving steps -----------------------------------------------------------------------


class _Driven:
    """Steps being driven: iterating gives each step, sending them ``sent`` (what the last
    wait came to) first."""

    def __init__(self, steps: Generator, sent: Any = None) -> None:
        self.steps = steps
        self.sent = sent

    def __iter__(self) -> _Driven:
        return self

    def __next__(self) -> Any:
        sent, self.sent = self.sent, None
        return self.steps.send(sent)  # (their end, StopIteration, ends the iteration)


def _result(steps: Steps[T]) -> StreamSteps[T]:
    """A call's steps as a stream that emits their result."""
    yield Emit((yield from steps))


def blocking_stream(steps: StreamSteps[T], sent: Any = None) -> Generator[T, None, None]:
    """Drive ``steps`` (first sending them ``sent``), blocking on each wait; yield what
    they emit. Closing the iterator closes them."""
    driven = _Driven(steps, sent)
    with contextlib.closing(steps):
        for step in driven:
            if isinstance(step, Emit):
                yield step.value
            else:
                driven.sent = step()


def blocking_call(steps: Steps[T]) -> T:
    """Drive ``steps`` to their end, blocking on each wait; return their result."""
    with contextlib.closing(blocking_stream(_result(steps))) as values:
        return next(values)


async def awaiting_stream(steps: StreamSteps[T]) -> AsyncGenerator[T, None]:
    """``blocking_stream``, awaiting each wait."""
    driven = _Driven(steps)
    with contextlib.closing(steps):
        for step in driven:
            if isinstance(step, Emit):
                yield step.value
            else:
                driven.sent = await step()


async def awaiting_call(steps: Steps[T]) -> T:
    """``blocking_call``, awaiting each wait."""
    async with contextlib.aclosing(awaiting_stream(_result(steps))) as values:
        return await anext(values)


# -- the calls, and each client's method of them -------------------------------------------


class call(Generic[P, T]):
    """A ``Calls`` method written as steps: ``Client`` gets a method of it that blocks,
    ``AsyncClient`` a coroutine method."""

    def __init__(self, steps: Callable[Concatenate[Any, P], Steps[T]]) -> None:
        self.steps = steps
        self.__doc__ = steps.__doc__

    if TYPE_CHECKING:

        @overload
        def __get__(self, client: None, owner: type) -> call[P, T]: ...
        @overload
        def __get__(self, client: Blocking, owner: type) -> Callable[P, T]: ...
        @overload
        def __get__(self, client: Awaiting, owner: type) -> Callable[P, Coroutine[Any, Any, T]]: ...
        def __get__(self, client: Any, owner: type) -> Any: ...


class streams(Generic[P, T]):
    """A ``Calls`` method written as a stream's steps: ``Client`` gets a method of it that
    returns an iterator, ``AsyncClient`` one that returns an async iterator. ``eager``:
    ``Client``'s takes the first step (a wait) at the call, before any iteration."""

    def __init__(
        self, steps: Callable[Concatenate[Any, P], StreamSteps[T]], eager: bool = False
    ) -> None:
        self.steps = steps
        self.eager = eager
        self.__doc__ = steps.__doc__

    @classmethod
    def eagerly(cls, steps: Callable[Concatenate[Any, P], StreamSteps[T]]) -> streams[P, T]:
        return cls(steps, eager=True)

    if TYPE_CHECKING:

        @overload
        def __get__(self, client: None, owner: type) -> streams[P, T]: ...
        @overload
        def __get__(self, client: Blocking, owner: type) -> Callable[P, Iterator[T]]: ...
        @overload
        def __get__(self, client: Awaiting, owner: type) -> Callable[P, AsyncIterator[T]]: ...
        def __get__(self, client: Any, owner: type) -> Any: ...


Spec = call | streams


def blocking(spec: Spec) -> Callable[..., Any]:
    """``Client``'s method of ``spec``: it blocks on each wait (a stream's, on each
    iteration; an eager one's first, at the call)."""
    if isinstance(spec, call):
        steps = spec.steps

        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            return blocking_call(steps(self, *args, **kwargs))

        return _method(run, spec, "{}")
    stream_steps, eager = spec.steps, spec.eager

    def stream(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        started = stream_steps(self, *args, **kwargs)
        if not eager:
            return blocking_stream(started)
        try:
            first = next(started)
            assert not isinstance(first, Emit), "an eager stream's first step is a wait"
            came = first()
        except BaseException:
            started.close()
            raise
        return blocking_stream(started, came)

    return _method(stream, spec, "Iterator[{}]")


def awaiting(spec: Spec) -> Callable[..., Any]:
    """``AsyncClient``'s method of ``spec``: a coroutine that awaits each wait (a stream's
    returns an async iterator that does)."""
    if isinstance(spec, call):
        steps = spec.steps

        async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await awaiting_call(steps(self, *args, **kwargs))

        return _method(run, spec, "{}")
    stream_steps = spec.steps

    def stream(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        return awaiting_stream(stream_steps(self, *args, **kwargs))

    return _method(stream, spec, "AsyncIterator[{}]")


def _method(method: Callable[..., Any], spec: Spec, returns: str) -> Callable[..., Any]:
    """``method`` under the name, docstring and signature of ``spec``'s steps, but for what
    it returns: ``returns`` of what the steps' type is of (``Steps[X]``: ``X``)."""
    functools.update_wrapper(method, spec.steps)
    signature = inspect.signature(spec.steps)
    of = str(signature.return_annotation).partition("[")[2].removesuffix("]")
    signature = signature.replace(return_annotation=returns.format(of))
    method.__signature__ = signature  # type: ignore[attr-defined]
    return method
