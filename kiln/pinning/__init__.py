"""The pins' lifecycle: lock them to digests, preflight a new vLLM, rotate them.

    lock.py     ``pin lock``: resolve each pin's image to its digest, write it to ``pins.toml``
    bump.py     ``pin bump``: the candidate, and the preflight of every patch and image on it
    rotate.py   ``pin bump --write``: ``pins.toml`` and the verdict record, together or not at all
    upstream.py ``pin bump --upstream-tests``: vLLM's own tests on the candidate's CPU build

The pins themselves (the data) are ``kiln.pins``.
"""
