"""Which build of the per-chunk path the tests run on (proxy/build.py), for the few tests
that only the pure-Python source can run."""

from __future__ import annotations

import pytest

from proxy.build import compiled_modules

#: A test that makes the measuring fail by replacing a StreamObserver method: a compiled
#: class is a C type, whose methods cannot be replaced. What these tests check is the
#: relay's answer to a failing observer, code that is not compiled; the pure-Python pass
#: of .ci/run runs them.
replaces_observer_methods = pytest.mark.skipif(
    "proxy.core.observe" in compiled_modules(),
    reason="replaces a StreamObserver method; a compiled class's cannot be (the pure pass runs it)",
)
