"""The harness: this checkout on the path, the load generator, and the processes
started, pinned and measured from /proc."""
