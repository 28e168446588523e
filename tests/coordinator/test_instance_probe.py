"""The coordinator's `/health` probe over plain asyncio: 200 is an answer; another status, silence, a refused
connection or a bad address is none, within the probe's deadline."""

from __future__ import annotations

import asyncio

from coordinator.instance_probe import health_answers
from tests.helpers import free_port


async def serve(status_line: bytes | None) -> tuple[asyncio.Server, str]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if status_line is None:  # a hung engine: reads the request, answers nothing
            await asyncio.sleep(5)
        else:
            writer.write(status_line + b"\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_only_a_200_is_an_answer():
    for status, expected in ((b"HTTP/1.1 200 OK", True), (b"HTTP/1.1 503 Service Unavailable", False),
                             (b"HTTP/1.1 302 Found", False), (b"garbage", False)):  # fmt: skip
        server, address = await serve(status)
        async with server:
            assert await health_answers(address, 2.0) is expected, status


async def test_silence_a_refused_connection_and_a_bad_address_are_no_answer_within_the_deadline():
    server, address = await serve(None)
    loop = asyncio.get_running_loop()
    async with server:
        started = loop.time()
        assert not await health_answers(address, 0.2)
        assert loop.time() - started < 1.0
    assert not await health_answers(f"127.0.0.1:{free_port()}", 1.0)
    assert not await health_answers("no-port", 1.0)
