"""The warm layer: vLLM's compile caches, made by booting the built image once, baked as one more layer.

Public API (``kiln.warm``):
    (the key, the one-line refusal of a cache made for other inputs, the layer: ``kiln.image.warmlayer``)
    capture(rootfs, host_paths) -> dict     the files vLLM and its compilers wrote, path trap checked
    write_bundle / read_bundle              the captured caches on disk
    with_warm(prepared, bundle) -> PreparedBuild the build with the warm layer, env and records
    REQUESTS, send_requests(url, model)     the fixed request set (greedy; batch shapes 1, 2, 4)
    boot_chroot(...), stop(process)         the image's own vLLM from its files, in a chroot

docs/WARM.md tells the story: ``build.py warm`` boots, captures and writes a bundle;
``build.py build --warm DIR`` checks the bundle's key against the build's own inputs and bakes it.
"""
