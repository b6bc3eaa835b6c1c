"""The open-file limit of a serving process: each proxied stream holds two descriptors.

A stream through the proxy holds two sockets, the client's and the upstream's, so the
soft RLIMIT_NOFILE bounds the streams one process can carry: about 500 at the usual
default of 1024 (systemd's DefaultLimitNOFILE=1024:524288, and what containers started
under it inherit). Past it nothing degrades gently: with 150 streams opened at once
under a soft limit of 128, every one failed, 108 answered 502 with "upstream: OSError:
[Errno 24] Too many open files" and 42 dropped unanswered (uvloop accepts and closes a
connection it has no descriptor for), because the clients' connections took every
descriptor before any upstream connection was opened.

vLLM raises its own soft limit to 65535 at start (vllm 0.32.0,
vllm/entrypoints/launchers/launcher.py calls vllm/utils/system_utils.py `set_ulimit`, "to
avoid footguns where uvicorn drops requests with too many concurrent requests active"),
so a proxy in front of it must carry as many: `tokenprobe serve` raises its soft limit
to the same 65535, or to the hard limit where that is lower (only the operator can raise
a hard limit: `ulimit -Hn`, systemd's LimitNOFILE=, docker's --ulimit nofile=), and says
at start what it has and about how many streams that carries. Worker processes
(`--workers`) inherit the limit. `tokenprobe bench` raises it too (one connection a
request in flight), as sglang's bench_serving does.
"""

from __future__ import annotations

from dataclasses import dataclass

#: vLLM's own target (see above).
TARGET = 65535
#: Descriptors a serving process holds besides its streams' sockets: the listener, the
#: event loop's, standard streams, the upstream client's idle pool and the imports' files
#: (about 30 at start here); the rest is two a stream.
RESERVED = 64


#: A limit of none (RLIM_INFINITY), as OpenFileLimit holds it.
UNLIMITED = -1


@dataclass(frozen=True, slots=True)
class OpenFileLimit:
    before: int  # the soft limit the process started with (UNLIMITED: none)
    soft: int  # the soft limit it runs with
    hard: int  # the hard limit

    @property
    def streams(self) -> int | None:
        """About how many streams the soft limit carries at once (None: no limit)."""
        return None if self.soft == UNLIMITED else max(0, (self.soft - RESERVED) // 2)

    def describe(self) -> str:
        def shown(limit: int) -> str:
            return "unlimited" if limit == UNLIMITED else str(limit)

        streams = self.streams
        room = (
            "no limit on streams"
            if streams is None
            else f"room for about {streams:,} concurrent streams"
        )
        if self.soft != self.before:
            return (
                f"open files: soft limit raised from {self.before} to {self.soft} "
                f"(hard {shown(self.hard)}), {room}"
            )
        if self.soft != UNLIMITED and self.soft < TARGET:
            return (
                f"open files: limited to {self.soft} by the hard limit, {room}; raise the "
                "hard limit for more (ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=)"
            )
        return f"open files: soft limit {shown(self.soft)} (hard {shown(self.hard)}), {room}"


def raise_open_file_limit(target: int = TARGET) -> OpenFileLimit | None:
    """Raise this process's soft RLIMIT_NOFILE to `target`, or to the hard limit where that
    is lower; never lowers it. None where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    kind, infinite = resource.RLIMIT_NOFILE, resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(kind)
    wanted = target if hard == infinite else min(target, hard)
    now = soft
    if soft != infinite and soft < wanted:
        try:
            resource.setrlimit(kind, (wanted, hard))
            now = wanted
        except (ValueError, OSError):  # a platform that refuses: keep what there is
            pass

    def held(limit: int) -> int:
        return UNLIMITED if limit == infinite else limit

    return OpenFileLimit(before=held(soft), soft=held(now), hard=held(hard))
