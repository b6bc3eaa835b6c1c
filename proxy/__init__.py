"""tokenprobe: an OpenAI-compatible measuring reverse proxy."""

__version__ = "0.1.0"
