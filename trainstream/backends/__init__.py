"""The thin per-framework parts below the adapters: pinned host buffers, streams, events and copies for one device,
and the framework's CPU arithmetic probed once (:mod:`.torch`; JAX's in :mod:`.jax`). Imported by the adapters only;
neither adapter imports the other, and the core imports no backend.
"""
