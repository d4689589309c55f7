"""What agentrt needs from the host process, below every layer: private files and directories
(`private.py`), CPU thread settings (`cputhreads.py`), the shared libraries loaded (`libs.py`),
the cycle collector's time (`heap.py`). Knows nothing of models, engines or sessions."""
