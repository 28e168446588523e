"""Per-method authorization of gRPC calls by the caller's certificate identity (`tandem.tls`).

A component declares which roles may call which of its methods; anything it does not list is refused:

    RULES = {
        "/tandem.v1.Admin/": ("operator",),                    # a whole service
        "/tandem.v1.Registry/": ("agent/*",),                   # `*` ends a pattern: any node's agent
        "/tandem.v1.Conductor/GetIndexStats": ("operator", "coordinator"),   # one method
    }

The longest matching key wins. Roles in the interceptor's `revoked` set (`security.revoked_nodes`) are refused
whatever the rules say. Health is open to every mesh identity and reflection to the operator (`BASE_RULES`).
The interceptor answers a refused call with PERMISSION_DENIED naming the method and the caller, counts it in
`tandem_authz_denied_total`, and otherwise runs the handler with `tandem.tls.caller_var` set, for the checks that
depend on the request (a node agent may only register its own node's instances).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence

import grpc
from prometheus_client import Counter

from tandem import tls

log = logging.getLogger(__name__)

Rules = Mapping[str, Sequence[str]]

DENIED = Counter(
    "tandem_authz_denied_total",
    "gRPC calls refused because the caller's identity may not make them",
    ["method", "caller"],
)

#: Every mesh identity may ask for health; reflection describes the services to operators.
BASE_RULES: dict[str, tuple[str, ...]] = {
    "/grpc.health.v1.Health/": ("*",),
    "/grpc.reflection.v1alpha.ServerReflection/": ("operator",),
    "/grpc.reflection.v1.ServerReflection/": ("operator",),
}


def role_matches(pattern: str, role: str) -> bool:
    """`*` is any mesh identity; `agent/*` any role under `agent/`; otherwise equality."""
    if pattern == "*":
        return True
    if pattern.endswith("*"):
        return role.startswith(pattern[:-1]) and len(role) > len(pattern) - 1
    return role == pattern


def allowed_roles(rules: Rules, method: str) -> Sequence[str]:
    """The roles allowed to call `method` (`/pkg.Service/Method`): the longest matching rule, else none."""
    best = ""
    for key in rules:
        if (method == key or (key.endswith("/") and method.startswith(key))) and len(key) > len(best):
            best = key
    return rules[best] if best else ()


def is_allowed(rules: Rules, method: str, role: str | None) -> bool:
    """True when `role` may call `method`."""
    return role is not None and any(role_matches(p, role) for p in allowed_roles(rules, method))


def denial(method: str, role: str | None) -> str:
    """The PERMISSION_DENIED message: what was refused, to whom."""
    who = (
        tls.identity(role)
        if role and role != tls.CALLBACK_ROLE
        else (role or "a caller without a mesh identity")
    )
    return f"permission denied: {method} may not be called by {who}"


def refuse(method: str, role: str | None) -> str:
    """Counts and logs a refusal; returns its message."""
    DENIED.labels(method, role or "none").inc()
    message = denial(method, role)
    log.warning("call refused", extra={"method": method, "caller": role or "none"})
    return message


class AuthzInterceptor(grpc.aio.ServerInterceptor):
    """Checks each call's caller against `rules` before its handler runs."""

    def __init__(self, rules: Rules, revoked: Collection[str] = ()) -> None:
        self.rules = {**BASE_RULES, **rules}
        self.revoked = frozenset(revoked)  # roles refused whatever the rules say (revoked certificates)
        # method -> (the service's handler, its guarded wrapper): built once per method, not per call.
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        guarded = _guarded(handler, method, self.rules, self.revoked)
        self._guarded[method] = (handler, guarded)
        return guarded


def _guarded(
    handler: grpc.RpcMethodHandler, method: str, rules: Rules, revoked: frozenset[str] = frozenset()
) -> grpc.RpcMethodHandler:
    allowed = allowed_roles(rules, method)

    async def authorize(context: grpc.aio.ServicerContext) -> None:
        role = tls.context_caller_role(context)
        if role is not None and role in revoked:
            message = refuse(method, role) + " (its certificate is revoked: security.revoked_nodes)"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
        if role is None or not any(role_matches(p, role) for p in allowed):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refuse(method, role))
        tls.caller_var.set(role)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            await authorize(context)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
    if handler.unary_stream:
        inner_us = handler.unary_stream
        if not inspect.isasyncgenfunction(inner_us):  # writes with context.write (e.g. Health/Watch)

            async def unary_stream_writer(request, context):
                await authorize(context)
                await inner_us(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream_writer, **kwargs)

        async def unary_stream(request, context):
            await authorize(context)
            async for reply in inner_us(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(request_iterator, context):
            await authorize(context)
            return await inner_su(request_iterator, context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
    inner_ss = handler.stream_stream
    if not inspect.isasyncgenfunction(inner_ss):

        async def stream_stream_writer(request_iterator, context):
            await authorize(context)
            await inner_ss(request_iterator, context)

        return grpc.stream_stream_rpc_method_handler(stream_stream_writer, **kwargs)

    async def stream_stream(request_iterator, context):
        await authorize(context)
        async for reply in inner_ss(request_iterator, context):
            yield reply

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)
