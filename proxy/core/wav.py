"""The audio format vLLM's speech APIs take, and a small WAV file of it for load and demos.

vLLM's realtime API takes base64 PCM16, 16 kHz, mono (vllm/entrypoints/speech_to_text/
realtime/protocol.py); the file APIs take any audio file, and this is the smallest one.
"""

from __future__ import annotations

import math
import struct

SAMPLE_RATE = 16_000
#: PCM16 mono at 16 kHz.
BYTES_PER_SECOND = 2 * SAMPLE_RATE


def pcm16(seconds: float, hz: float = 440.0) -> bytes:
    """`seconds` of a quiet sine tone as PCM16 mono samples at 16 kHz."""
    n = int(SAMPLE_RATE * seconds)
    return b"".join(
        struct.pack("<h", int(3000 * math.sin(2 * math.pi * hz * i / SAMPLE_RATE)))
        for i in range(n)
    )


def wav(seconds: float) -> bytes:
    """A WAV file (RIFF, PCM16, 16 kHz, mono) of `pcm16(seconds)`."""
    data = pcm16(seconds)
    fmt = struct.pack("<HHIIHH", 1, 1, SAMPLE_RATE, BYTES_PER_SECOND, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
        + b"data" + struct.pack("<I", len(data)) + data
    )  # fmt: skip
