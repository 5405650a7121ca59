"""Methods of the registry's protocol (``registry.protocol``) implemented from their signatures, said once there.

- ``Forward(Store.latest)``: the method of another object of the same protocol (``attribute``): the etcd store
  answers reads from its mirror, an in-memory store.
- ``Remote(RegistryProtocol.acked, result=...)``: one request to the registry service, its arguments those of
  the signature as the wire carries them (an ``Identity`` as a dict, a ``ReleasePolicy`` as a dict, a collection
  as a list), its answer through ``result``: what the remote client does for every call that is nothing more.

Both are descriptors typed with the protocol method's own parameters, so a caller and mypy see the protocol's
signature, and a class that subclasses the protocol is checked against it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from refitflow.core.types import Identity
from refitflow.registry.messages import identity_to_dict
from refitflow.registry.release import ReleasePolicy

__all__ = ["Forward", "Remote", "wire_argument"]

P = ParamSpec("P")
R = TypeVar("R")


class Forward(Generic[P, R]):
    """``method`` as the object at ``attribute`` implements it (a bound method of that object)."""

    def __init__(self, method: Callable[Concatenate[Any, P], R], attribute: str = "mirror") -> None:
        self.name = method.__name__
        self.attribute = attribute

    @overload
    def __get__(self, obj: None, owner: type) -> Forward[P, R]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> Callable[P, R]: ...
    def __get__(self, obj: object | None, owner: type) -> Forward[P, R] | Callable[P, R]:
        if obj is None:
            return self
        method: Callable[P, R] = getattr(getattr(obj, self.attribute), self.name)
        return method


def wire_argument(value: Any) -> Any:
    """An argument as a request carries it."""
    if isinstance(value, Identity):
        return identity_to_dict(value)
    if isinstance(value, ReleasePolicy):
        return value.to_dict()
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Collection) and not isinstance(value, str | bytes):
        return list(value)
    return value


class Remote(Generic[P, R]):
    """``method`` carried out as the request of its name (``op``), sent with the owner's ``_request``."""

    def __init__(self, method: Callable[Concatenate[Any, P], Coroutine[Any, Any, R]], *,
                 result: Callable[[Any], R] | None = None, op: str | None = None) -> None:  # fmt: skip
        self.op = op or method.__name__
        self.signature = inspect.signature(method)
        self.result = result

    @overload
    def __get__(self, obj: None, owner: type) -> Remote[P, R]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> Callable[P, Coroutine[Any, Any, R]]: ...
    def __get__(self, obj: object | None, owner: type) -> Remote[P, R] | Callable[P, Coroutine[Any, Any, R]]:
        if obj is None:
            return self
        request: Callable[..., Awaitable[Any]] = obj._request  # type: ignore[attr-defined]

        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            bound = self.signature.bind(obj, *args, **kwargs)
            bound.apply_defaults()
            arguments = {k: wire_argument(v) for k, v in list(bound.arguments.items())[1:]}  # self left out
            found = await request(self.op, **arguments)
            return found if self.result is None else self.result(found)

        return call
