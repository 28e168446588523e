"""`python -m node_agent.pdeathsig PARENT_PID -- CMD [ARG...]`: runs CMD so that it gets SIGTERM when the agent dies.

Sets Linux's PR_SET_PDEATHSIG (kept across execve) and then execs CMD in place (same pid). This replaces a
`preexec_fn`: a preexec function forces fork() instead of vfork(), and in the threaded agent (gRPC threads) the
children then ran gRPC's fork handlers and died with SIGSEGV/SIGABRT before exec.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m node_agent.pdeathsig PARENT_PID -- CMD [ARG...]", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[2:]
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass  # not Linux: the agent still stops its children on a clean shutdown
    if os.getppid() != parent:  # the agent died before the signal was armed
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"cannot execute {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
