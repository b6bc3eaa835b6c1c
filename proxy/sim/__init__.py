"""A simulated backend that behaves like vLLM on the wire, for every API vLLM serves:
chat, completions, Anthropic Messages, OpenAI Responses, embeddings and the pooling
family, and the utility routes (see `app.py`); and, asked to, Ollama's native API
(`ollama.py`) and llama.cpp's `llama-server` chunks and `timings` (`llamacpp.py`).

Used by the demo, the end-to-end tests (with the proxy in front of it) and the
benchmarks. Timing, output and failures are set by `SimConfig` and per request by
`x-sim-*` headers (see `controls.py`); `SimState` records what it saw and did.
"""

from proxy.sim.app import SimApp, create_sim_app
from proxy.sim.config import SimConfig
from proxy.sim.state import SimRequest, SimState
from proxy.sim.tokens import completion_text

__all__ = ["SimApp", "SimConfig", "SimRequest", "SimState", "completion_text", "create_sim_app"]
